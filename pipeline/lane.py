"""Lane: one background thread that handles submitted items in order, behind a bounded queue.

The streaming render runs three lanes of work at once: the render loop (context + A2V of the next
step), the emission lane (SR + VAE decode of the last emission, ``Pipeline.run`` with
``overlap_emissions``) and the publisher lane (H.264/AAC encode + sinks, ``Publisher``). Each hands
its output to the next through a queue of ``depth`` items, so a fast producer waits for a slow
consumer instead of piling up tensors: memory stays bounded by the queue depths, never by the
video's length. Torch releases the GIL inside its kernels, so on a CPU the lanes run on different
cores.

Errors raised by the handler surface on the producer's next :meth:`submit` or on :meth:`finish`;
after an error the lane keeps draining (discarding) so the producer never blocks on a dead lane.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Lane(Generic[T]):
    def __init__(self, name: str, handler: Callable[[T], None], *, depth: int = 1) -> None:
        self.name = name
        self.handler = handler
        self._queue: queue.Queue[T | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"lane {self.name!r} is already running")
        self._error = None
        self._thread = threading.Thread(target=self._loop, name=f"longtake-{self.name}", daemon=True)
        self._thread.start()

    def submit(self, item: T) -> None:
        """Queue ``item``; waits while the queue is full, raising the handler's error if it failed."""
        if self._thread is None:
            raise RuntimeError(f"lane {self.name!r} is not running: call start() first")
        self.raise_pending()
        while True:  # wait for room, but notice a failed lane instead of blocking forever
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                self.raise_pending()

    def finish(self, *, ok: bool) -> None:
        """Handle what is queued (``ok``) or drop it (not ``ok``), stop the thread, then raise the
        handler's first error, if any."""
        thread, self._thread = self._thread, None
        if thread is not None:
            if not ok:
                self._drain()
            self._queue.put(None)
            thread.join()
        self.raise_pending()

    def raise_pending(self) -> None:
        if self._error is not None:
            raise self._error

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:
                continue
            try:
                self.handler(item)
            except BaseException as exc:
                self._error = exc

    def _drain(self) -> None:
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
