"""One attempt's delivery: the sinks a render writes into and what the job row learns from them.

Who calls what: :class:`worker.jobs.tasks.JobWorker` calls its :class:`DeliveryFactory` (default
:data:`s3_delivery`, injected through the constructor) once per attempt with the committed segments
and the lease-fenced ``on_commit``; the runner relays the render's fragments into ``sinks``; the
worker then asks ``verify(committed)`` whether the outputs exist (at finish), ``outputs()`` /
``partial_outputs()`` for the row, ``load_state`` for the resume point, ``discard(stale)`` when the
render refused that resume point and the job starts again, or ``abandon()`` when the job is given up.

The production delivery is :class:`worker.delivery.s3_sink.S3ProgressiveSink` (segments, HLS,
final MP4) plus, when the spec asks for one, a KVS live preview wrapped in :class:`BestEffortSink`
so that its failure costs the preview, not the job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from pipeline.media_types import Fragment, FrameSink, InitSegment
from worker.delivery.keys import job_prefix
from worker.delivery.kvs.putmedia import PutMediaClient
from worker.delivery.kvs.sink import KVSPreviewSink
from worker.delivery.s3_sink import S3ProgressiveSink
from worker.delivery.segment import SegmentRecord
from worker.delivery.storage import open_object_store
from worker.settings import Settings
from worker.spec import JobSpec

log = logging.getLogger(__name__)


class JobDelivery(Protocol):
    """Where one attempt's output goes. Built per attempt by the worker's :class:`DeliveryFactory`;
    ``on_commit`` must be called for each durably stored fragment (in index order) and raises
    :class:`worker.errors.LeaseLostError` when the lease is gone."""

    sinks: Sequence[FrameSink]

    def outputs(self) -> dict[str, str]: ...
    def partial_outputs(self) -> dict[str, str]: ...
    def load_state(self, key: str) -> bytes: ...
    def abandon(self) -> None: ...
    def discard(self, stale: Sequence[SegmentRecord]) -> None:
        """On a delivery built with no committed segments, before its render starts: remove what
        the ``stale`` segments (committed by earlier attempts, forgotten by the job row since) and
        their upload left in storage; the job renders from the beginning."""
        ...
    def verify(self, committed: Sequence[SegmentRecord]) -> str | None:
        """After a successful render, before the row is marked succeeded: None when every output
        the row will name exists (repairing what it can), else the reason."""
        ...


class DeliveryFactory(Protocol):
    """Builds one attempt's :class:`JobDelivery`; :data:`s3_delivery` is the production one. Passed
    to :class:`worker.jobs.tasks.JobWorker` (tests pass a fake there). ``attempt`` (1-based) and
    ``fence`` (raises :class:`worker.errors.LeaseLostError` once the lease is gone; to be called
    before every object write) fence the attempt's object writes as its commits are fenced."""

    def __call__(
        self,
        settings: Settings,
        *,
        tenant: str,
        job_id: str,
        spec: JobSpec,
        committed: Sequence[SegmentRecord],
        on_commit: Callable[[SegmentRecord], None],
        attempt: int = 0,
        fence: Callable[[], None] | None = None,
    ) -> JobDelivery: ...


class BestEffortSink:
    """Wraps a preview sink (KVS) so that its failure costs the preview, not the job: the first
    error is logged and the wrapped sink is dropped for the rest of the attempt."""

    def __init__(self, sink: FrameSink, what: str) -> None:
        self._sink: FrameSink | None = sink
        self._what = what

    def _call(self, fn: Callable[[FrameSink], None]) -> None:
        if self._sink is None:
            return
        try:
            fn(self._sink)
        except Exception as exc:
            log.warning("%s failed and is switched off for this attempt: %s", self._what, exc)
            sink, self._sink = self._sink, None
            try:
                sink.close(ok=False)
            except Exception as close_exc:
                log.warning("%s: close after failure failed too: %s", self._what, close_exc)

    def open(self, init: InitSegment) -> None:
        self._call(lambda s: s.open(init))

    def write(self, fragment: Fragment) -> None:
        self._call(lambda s: s.write(fragment))

    def close(self, *, ok: bool) -> None:
        self._call(lambda s: s.close(ok=ok))
        self._sink = None


class S3Delivery:
    """Adapter from :class:`worker.delivery.s3_sink.S3ProgressiveSink` to :class:`JobDelivery`."""

    def __init__(
        self,
        settings: Settings,
        *,
        tenant: str,
        job_id: str,
        spec: JobSpec,
        committed: Sequence[SegmentRecord],
        on_commit: Callable[[SegmentRecord], None],
        attempt: int = 0,
        fence: Callable[[], None] | None = None,
    ) -> None:
        """``attempt`` names this attempt's segment and state objects (``a<attempt>-seg_…``) and
        ``fence`` (the lease check) runs before every object write: see docs/delivery.md, "Fenced
        object writes"."""
        self.store = open_object_store(settings.object_store_url, endpoint_url=settings.s3_endpoint_url)
        self.prefix = job_prefix(tenant, job_id)
        self.sink = S3ProgressiveSink(
            self.store,
            self.prefix,
            committed=committed,
            on_commit=on_commit,
            preview=spec.preview.hls,
            state_every=settings.state_every,
            key_tag=f"a{attempt}-" if attempt else "",
            fence=fence,
        )
        self.sinks: Sequence[FrameSink] = [self.sink]
        if spec.preview.kvs is not None:
            client = PutMediaClient(
                spec.preview.kvs.stream_name,
                region=spec.preview.kvs.region,
                endpoint_url=settings.kvs_endpoint_url,
            )
            self.sinks = [self.sink, BestEffortSink(KVSPreviewSink(client), "kvs preview")]

    def outputs(self) -> dict[str, str]:
        return self.sink.outputs()

    def partial_outputs(self) -> dict[str, str]:
        out = {"segments": self.store.uri(self.prefix.rstrip("/")) + "/"}
        if self.sink.preview:
            out["hls"] = self.store.uri(self.sink.playlist_key)
        return out

    def load_state(self, key: str) -> bytes:
        return self.store.get_bytes(key)

    def verify(self, committed: Sequence[SegmentRecord]) -> str | None:
        return self.sink.verify_outputs(committed)

    def discard(self, stale: Sequence[SegmentRecord]) -> None:
        self.sink.discard(stale)

    def abandon(self) -> None:
        self.sink.abandon()


s3_delivery: DeliveryFactory = S3Delivery
"""The production delivery: preview segments + HLS + one final MP4 in ``object_store_url``."""
