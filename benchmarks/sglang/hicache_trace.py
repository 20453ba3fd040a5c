"""The request trace of the live HiCache run (:mod:`benchmarks.sglang.hicache_live`).

Multi-turn conversations, the shape of ``scripts/live_trace.py``'s: each opens with one
of a few shared system prompts and a first turn of 512 to 32000 tokens (the sizes cycle,
so every size gets the same number of conversations); each later turn is the whole
conversation so far (its prompts and the replies) plus a short new user message. Every
conversation's turn ``k`` is sent before any turn ``k + 1``, each turn in its own shuffled
order, so by its next turn a conversation's KV has been pushed out of the small device
pool and comes back from the host tier.

Every token id is used once in the whole trace, except those of the shared system
prompts, which always open a sequence. A token id therefore names its whole prefix (the
segment it belongs to follows one history only): content derived from (token id,
position) is content derived from the prefix, which is what the checker needs. Lengths
are whole pages (the tree caches whole pages only), scaled down by ``scale`` for small
runs.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

FIRST_TURN_TOKENS = (512, 1024, 2048, 4096, 8192, 16384, 32000)
SYSTEM_PROMPT_TOKENS = (256, 384, 512)
USER_TOKENS = 64
REPLY_TOKENS = 64


@dataclass(frozen=True)
class TraceShape:
    conversations: int = 21
    turns: int = 4
    seed: int = 0
    page_size: int = 64
    scale: int = 1
    """Every length is divided by this (then rounded up to whole pages)."""
    first_turn_tokens: tuple[int, ...] = FIRST_TURN_TOKENS
    system_prompt_tokens: tuple[int, ...] = SYSTEM_PROMPT_TOKENS
    user_tokens: int = USER_TOKENS
    reply_tokens: int = REPLY_TOKENS
    first_token_id: int = 1
    """Token ids are handed out from here (a second trace in one cache starts past the first)."""

    def length(self, tokens: int) -> int:
        """``tokens`` scaled, in whole pages, at least one page."""
        pages = -(-tokens // (self.scale * self.page_size))
        return max(1, pages) * self.page_size


@dataclass(frozen=True)
class Request:
    index: int
    conversation: int
    turn: int
    first_turn_tokens: int
    """The conversation's first-turn size before scaling: its size bucket."""
    prompt_tokens: int
    tokens: tuple[int, ...]
    """The prompt and the reply the model gives it: what the request leaves in the cache."""


@dataclass
class _Conversation:
    index: int
    size: int
    history: list[int] = field(default_factory=list)


def _ids(counter: Iterator[int], count: int) -> list[int]:
    return list(itertools.islice(counter, count))


def make_trace(shape: TraceShape) -> list[Request]:
    """The requests in the order they are sent."""
    if shape.conversations < 1 or shape.turns < 1:
        raise ValueError("a trace needs at least one conversation and one turn")
    rng = random.Random(shape.seed)
    counter = itertools.count(shape.first_token_id)
    systems = [_ids(counter, shape.length(n)) for n in shape.system_prompt_tokens]
    conversations = []
    for index in range(shape.conversations):
        size = shape.first_turn_tokens[index % len(shape.first_turn_tokens)]
        system = systems[rng.randrange(len(systems))]
        first = max(shape.length(size) - len(system), shape.page_size)
        conversations.append(_Conversation(index, size, system + _ids(counter, first)))
    requests: list[Request] = []
    for turn in range(shape.turns):
        order = list(range(shape.conversations))
        rng.shuffle(order)
        for index in order:
            conversation = conversations[index]
            if turn > 0:
                conversation.history += _ids(counter, shape.length(shape.user_tokens))
            prompt = len(conversation.history)
            conversation.history += _ids(counter, shape.length(shape.reply_tokens))
            requests.append(
                Request(
                    index=len(requests),
                    conversation=index,
                    turn=turn,
                    first_turn_tokens=conversation.size,
                    prompt_tokens=prompt,
                    tokens=tuple(conversation.history),
                )
            )
    return requests


def last_token_id(requests: Sequence[Request]) -> int:
    """The largest token id the trace uses (0 for none)."""
    return max((max(r.tokens) for r in requests), default=0)
