"""A worker thread that issues jobs' copies in the order they were handed to it.

vLLM calls a handler's ``transfer_async`` on the thread that then queues the model's next
forward, so every microsecond a job's issuing takes there delays every running request's
step: an MHA load issues one DMA descriptor a page, 9-35 ms at 8k-32k tokens. Handed to an
:class:`Issuer`, the issuing runs on its thread instead (the driver and CUDA runtime calls
release the GIL) and the caller goes on once the job is planned.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class Issued:
    """One piece of work handed to an :class:`Issuer`: done once it has run, with the
    exception it raised, if any."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        """Block until the work has run (or raised)."""
        self._done.wait()

    def _finish(self, error: BaseException | None) -> None:
        self.error = error
        self._done.set()


class Issuer:
    """One daemon thread running the work handed to it, one at a time, in order.

    ``prepare`` runs first on the thread (a GPU's: making the device current there, as the
    CUDA runtime keeps it per thread). Work that raises is marked so (:attr:`Issued.error`)
    and the next runs. :meth:`close` lets the handed work finish, then ends the thread."""

    def __init__(self, name: str, prepare: Callable[[], None] | None = None) -> None:
        self._work: queue.SimpleQueue[tuple[Callable[[], None], Issued] | None] = (
            queue.SimpleQueue()
        )
        self._closed = False
        self._prepare_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(prepare,), name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], None]) -> Issued:
        """Hand ``work`` to the thread; its :class:`Issued` tells when it has run."""
        if self._closed:
            raise RuntimeError("the issuer is closed")
        issued = Issued()
        self._work.put((work, issued))
        return issued

    def idle(self) -> None:
        """Block until all work handed over so far has run."""
        if not self._closed:
            self.submit(lambda: None).wait()

    def close(self) -> None:
        """Run what was handed over, then end the thread (again: nothing)."""
        if self._closed:
            return
        self._closed = True
        self._work.put(None)
        self._thread.join()

    def _run(self, prepare: Callable[[], None] | None) -> None:
        if prepare is not None:
            try:
                prepare()
            except BaseException as exc:
                self._prepare_error = exc
        while (item := self._work.get()) is not None:
            work, issued = item
            if self._prepare_error is not None:
                issued._finish(self._prepare_error)
                continue
            try:
                work()
            except BaseException as exc:
                issued._finish(exc)
            else:
                issued._finish(None)
