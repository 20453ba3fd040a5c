"""The live trace's client (``scripts/live_trace.py run``): sends the conversations to an
OpenAI-compatible server and times each request as a user sees it.

Prompts go as token ids (the server runs with ``--skip-tokenizer-init``) over HTTP,
streamed, so that the time to the first token is seen. Standard library only: the client
runs beside the server on the GPU machine, whose Python may lack anything else.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from benchmarks.vllm.live_trace_metrics import difference, parse_metrics
from benchmarks.vllm.live_trace_result import Result
from benchmarks.vllm.live_trace_shape import Conversation, turn_orders


class Server:
    """The server's HTTP endpoints, one connection per call (threads share nothing)."""

    def __init__(self, url: str, model: str, max_tokens: int, timeout_s: float = 600.0) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.model, self.max_tokens, self.timeout_s = model, max_tokens, timeout_s

    def _connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)

    def get(self, path: str) -> str:
        connection = self._connection()
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            body = response.read().decode()
            if response.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {response.status}: {body[:200]}")
            return body
        finally:
            connection.close()

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.get("/metrics"))

    def complete(self, prompt: list[int]) -> tuple[float, float, list[int]]:
        """(seconds to the first token, seconds to the last, the output token ids)."""
        body = json.dumps(
            {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": self.max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
        )
        connection = self._connection()
        started = time.perf_counter()
        first: float | None = None
        output: list[int] = []
        try:
            connection.request(
                "POST", "/v1/completions", body, {"Content-Type": "application/json"}
            )
            response = connection.getresponse()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {response.read().decode()[:300]}")
            for event in server_sent_events(response):
                for choice in event.get("choices", ()):
                    ids = choice.get("token_ids") or []
                    if ids and first is None:
                        first = time.perf_counter() - started
                    output += ids
        finally:
            connection.close()
        total = time.perf_counter() - started
        if first is None:
            raise RuntimeError("the stream carried no token ids (is return_token_ids served?)")
        return first, total, output


def server_sent_events(stream: Any) -> Iterator[dict[str, Any]]:
    """The JSON events of an OpenAI-style stream, up to ``[DONE]``."""
    for raw in stream:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def run_sequential(server: Server, conversations: list[Conversation], seed: int) -> list[Result]:
    results = []
    for turn, order in enumerate(turn_orders(len(conversations), _turns(conversations), seed)):
        for index in order:
            conversation = conversations[index]
            prompt = conversation.prompt(turn)
            before = server.metrics()
            ttft, total, output = server.complete(prompt)
            counted = difference(server.metrics(), before)
            conversation.history = prompt + output
            results.append(
                Result(index, conversation.size, turn, len(prompt), ttft, total, output, counted)
            )
    return results


def run_concurrent(
    server: Server, conversations: list[Conversation], seed: int, concurrency: int
) -> tuple[list[Result], float]:
    """Each turn's requests with ``concurrency`` in flight; (results, wall seconds)."""
    results: list[Result] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    started = time.perf_counter()
    for turn, order in enumerate(turn_orders(len(conversations), _turns(conversations), seed)):
        queue = list(order)

        def worker(turn: int = turn, queue: list[int] = queue) -> None:
            while True:
                with lock:
                    if not queue or errors:
                        return
                    index = queue.pop(0)
                conversation = conversations[index]
                prompt = conversation.prompt(turn)
                try:
                    ttft, total, output = server.complete(prompt)
                except BaseException as exc:
                    with lock:
                        errors.append(exc)
                    return
                conversation.history = prompt + output
                with lock:
                    results.append(
                        Result(index, conversation.size, turn, len(prompt), ttft, total, output)
                    )

        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
    return results, time.perf_counter() - started


def _turns(conversations: list[Conversation]) -> int:
    return 1 + len(conversations[0].later_users)
