"""Carry a render's output from rank 0 to the sinks in the engine's parent process.

Who calls this: the render job on each rank builds ``RelaySink(ctx)`` and hands it to the pipeline as
its only sink (on ranks other than 0 it discards, so the SPMD code needs no branch); the worker, in
the parent, passes ``SinkRelay(sinks).on_event`` to :meth:`NodeEngine.run` so the real sinks (S3
progressive upload, HLS, KVS, local file — the ones that talk to the outside and fence commits with
the job's lease) run next to the job row, never inside a rank. Each message is the
:class:`~pipeline.media_types.InitSegment` or :class:`~pipeline.media_types.Fragment` itself (bytes,
pickled once through the rank's pipe); nothing is kept on either side after it is delivered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.media_types import Fragment, FrameSink, InitSegment
from pipeline.placement.rank import RankContext


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
    """Parent side: replays what :class:`RelaySink` published onto the real sinks, in order.

    A sink that raises makes ``NodeEngine.run`` ask the job to cancel and re-raise that error (the
    worker's lease-lost and upload errors end the render that way); events after it are dropped, so
    the caller closes its sinks with ``ok=False`` itself.
    """

    def __init__(self, sinks: Sequence[FrameSink]) -> None:
        self._sinks = list(sinks)

    def on_event(self, event: object) -> None:
        if isinstance(event, InitSegment):
            for sink in self._sinks:
                sink.open(event)
        elif isinstance(event, Fragment):
            for sink in self._sinks:
                sink.write(event)
        elif isinstance(event, SinkClosed):
            for sink in self._sinks:
                sink.close(ok=event.ok)
        else:
            raise TypeError(
                f"SinkRelay got a {type(event).__name__} event; the render job must publish only "
                "through RelaySink (InitSegment, Fragment, close)"
            )
