"""Carry a render's output from rank 0 to the sinks in the engine's parent process.

Who calls this: the render job on each rank builds ``RelaySink(ctx)`` and hands it to the renderer as
its only sink (on ranks other than 0 it discards, so the SPMD code needs no branch); the parent (the
worker, the tests) passes ``SinkRelay(sinks, ...).on_event`` to :meth:`NodeEngine.run` so the real
sinks (S3 progressive upload, HLS, KVS, local file — the ones that talk to the outside and fence
commits with the job's lease) run next to the job row, never inside a rank. Each message is the
:class:`~pipeline.media_types.InitSegment`, :class:`~pipeline.media_types.Fragment`,
:class:`SinkClosed` or :class:`~pipeline.request.RenderProgress` itself (pickled once through the
rank's pipe); nothing is kept on either side after it is delivered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.host import release_free_heap
from pipeline.media_types import Fragment, FrameSink, InitSegment
from pipeline.request import RenderProgress

if TYPE_CHECKING:  # torch-free at import: the worker's Celery parent imports this module
    from pipeline.placement.rank import RankContext

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SinkClosed:
    """The relayed ``close(ok=...)`` call."""

    ok: bool


class RelaySink:
    """A :class:`FrameSink` for rank processes: rank 0 publishes each call to the parent."""

    def __init__(self, ctx: RankContext) -> None:
        self._ctx = ctx

    def open(self, init: InitSegment) -> None:
        if self._ctx.is_publisher:
            self._ctx.publish(init)

    def write(self, fragment: Fragment) -> None:
        if self._ctx.is_publisher:
            self._ctx.publish(fragment)

    def close(self, *, ok: bool) -> None:
        if self._ctx.is_publisher:
            self._ctx.publish(SinkClosed(ok))


class SinkRelay:
    """Parent side: replays what rank 0 published onto the real sinks and callbacks, in order, on
    the thread that called ``NodeEngine.run``.

    ``on_fragment`` sees each fragment before the sinks; ``on_progress`` each progress record. After
    the sinks have taken a fragment, the free heap goes back to the kernel
    (:func:`~pipeline.host.release_free_heap`, once per fragment, as the rank does once per
    emission): the worker process allocates and frees each fragment and its resume state (~1.25 MB
    for the tiny preset) on its threads' arenas, and without the trim its resident set stepped up
    over a long job (docs/benchmarks.md, "The worker's heap"). A sink that raises makes
    ``NodeEngine.run`` ask the job to cancel and re-raise that error (the worker's
    lease-lost and upload errors end the render that way); events after it are dropped, so the
    caller then closes the sinks with ``close(ok=False)`` (``opened and not closed`` tells whether
    that is still due).
    """

    def __init__(
        self,
        sinks: Sequence[FrameSink],
        *,
        on_progress: Callable[[RenderProgress], None] | None = None,
        on_fragment: Callable[[Fragment], None] | None = None,
    ) -> None:
        self._sinks = list(sinks)
        self._on_progress = on_progress
        self._on_fragment = on_fragment
        self.opened = False
        self.closed = False

    def on_event(self, event: object) -> None:
        if isinstance(event, InitSegment):
            self.opened = True
            for sink in self._sinks:
                sink.open(event)
        elif isinstance(event, Fragment):
            if self._on_fragment is not None:
                self._on_fragment(event)
            for sink in self._sinks:
                sink.write(event)
            release_free_heap()  # as Pipeline._emit does in the rank: RSS follows live memory
        elif isinstance(event, SinkClosed):
            self.close(ok=event.ok, raise_errors=True)
        elif isinstance(event, RenderProgress):
            if self._on_progress is not None:
                self._on_progress(event)
        else:
            raise TypeError(
                f"SinkRelay got a {type(event).__name__} event; a render job publishes only a RenderEvent "
                "(InitSegment, Fragment, SinkClosed, RenderProgress)"
            )

    def close(self, *, ok: bool, raise_errors: bool = False) -> None:
        """Close every sink (each even if an earlier one raised); re-raise the first error when
        ``raise_errors``, else log it."""
        self.closed = True
        first: BaseException | None = None
        for sink in self._sinks:
            try:
                sink.close(ok=ok)
            except Exception as exc:
                if first is None:
                    first = exc
                if not raise_errors:
                    log.warning("closing sink %s (ok=%s) failed: %s", type(sink).__name__, ok, exc)
        if raise_errors and first is not None:
            raise first
