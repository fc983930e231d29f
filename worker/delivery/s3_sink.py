"""Progressive delivery to object storage: preview segments + HLS playlist + one final MP4.

Size: ~640 lines, one class on purpose: the upload thread's state (pending run, multipart parts,
commits waiting for their part, the resume reconciliation) is read by every step, and the resume
path must be read next to the write path it replays.

Who calls what: the worker builds one :class:`S3ProgressiveSink` per render attempt and hands it to
``pipeline.render.render`` as a :class:`~pipeline.media_types.FrameSink`. The render thread calls
``open(init)``, ``write(fragment)`` per emission and ``close(ok=...)``; everything that touches the
store happens on the sink's own upload thread, in fragment order:

1. preview on: ``seg_%05d.m4s`` (the fragment), ``state_%05d.bin`` (its resume state, for every
   ``state_every``-th fragment: a state is larger than a segment with the tiny preset), then
   ``index.m3u8`` (HLS EVENT playlist, ``EXT-X-MAP`` -> ``init.mp4``) rewritten so it references only
   segments already uploaded (skipped when the rewrites would exceed ``playlist_budget`` of the
   segment bytes — only in very long low-bitrate renders); then ``on_commit(SegmentRecord)``;
2. the fragment joins the pending run of the final MP4; whenever init + pending runs reach
   ``part_min_bytes`` (5 MiB, S3's minimum part size) the run is uploaded as the next part of one
   multipart upload of ``final.mp4``, and a :class:`MultipartState` JSON (upload id, parts with their
   fragment ranges) is stored at ``final.mp4.multipart.json`` and passed to ``on_multipart``;
3. ``close(ok=True)``: the last (possibly small) part is uploaded and the upload completed, so
   ``final.mp4`` = init + all fragments, byte for byte. A render whose whole MP4 stays under
   ``part_min_bytes`` never starts a multipart upload: ``final.mp4`` is one put at close.

With the preview off, fragments are committed when the part that carries them is uploaded (their
``key`` is then the final MP4's key; the newest ``state_every``-th fragment of each part carries a
``state_key``).

Fencing: the worker passes ``key_tag`` (``a<attempt>-``: segment and state objects are named per
attempt, and the committed row names the key, so readers — the playlist, the API — only ever see
committed objects) and ``fence`` (its lease check, run before every write; a stale worker that
lost its lease writes nothing more).

Resume: a retried render restarts after the newest *stored* state, so it may re-make fragments that
are already committed; ``write`` checks each against its committed checksum and sends nothing.

Back-pressure and outages: ``write`` hands the fragment to the upload thread and returns. The most
recent ``max_in_memory`` (default 2) undelivered fragments stay in RAM; older ones are spooled to an
anonymous temp file, so an S3 outage costs disk, not memory. ``write`` blocks only when the backlog
exceeds ``max_backlog_bytes`` (default 1 GiB). Every store call is retried (the store's bounded
tenacity retries, then the sink's own loop) until ``give_up_after_s`` of continuous failure; then
the sink is failed and the next ``write``/``close`` raises :class:`SinkError` with the reason.
Committed segments, uploaded parts and the multipart state stay in the store, so a resumed sink
(``committed=...`` from the job row, ``multipart_state`` from the store) re-sends none of them.

What the sink keeps: the pending run of the final MP4 (< ``part_min_bytes`` + one fragment), the
backlog above, the playlist as its text (~40 bytes per committed segment; the HLS playlist lists
every segment) and, on a resume, the sha256 digests of the segments committed before (32 bytes
each) — never frames, and no object per fragment (issue 16: ~1 kB per fragment was kept before).
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TypeVar

from pipeline.errors import SinkError
from pipeline.media_types import Fragment, InitSegment
from pipeline.sinks import (
    HLS_ENDLIST,
    HLS_INIT,
    HLS_PLAYLIST,
    hls_playlist_entry,
    hls_playlist_head,
    hls_segment_name,
    hls_target_duration,
)
from worker.delivery.keys import check_relative_key, safe_key
from worker.delivery.object_store import ObjectStore
from worker.delivery.segment import SegmentRecord
from worker.errors import ObjectNotFoundError, StorageError

logger = logging.getLogger(__name__)

T = TypeVar("T")

MIB = 1 << 20
S3_MIN_PART_BYTES = 5 * MIB
FINAL_NAME = "final.mp4"
INIT_NAME = HLS_INIT
PLAYLIST_NAME = HLS_PLAYLIST
MULTIPART_STATE_NAME = "final.mp4.multipart.json"


@dataclass(frozen=True)
class UploadedPart:
    """One part of the final MP4's multipart upload and the fragments it carries (inclusive)."""

    part_number: int
    etag: str
    first_index: int  # first fragment index in this part (part 1 also starts with the init segment)
    last_index: int
    nbytes: int


@dataclass(frozen=True)
class MultipartState:
    """Enough to continue the final MP4's multipart upload after a crash."""

    key: str
    upload_id: str
    init_sha256: str
    parts: tuple[UploadedPart, ...] = ()

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> MultipartState:
        raw = json.loads(data)
        return cls(
            key=raw["key"], upload_id=raw["upload_id"], init_sha256=raw["init_sha256"],
            parts=tuple(UploadedPart(**p) for p in raw["parts"]),
        )


@dataclass
class DeliveryCounters:
    """Bytes the sink put on the wire, per purpose (every attempt counts)."""

    init_bytes: int = 0
    segment_bytes: int = 0
    playlist_bytes: int = 0
    part_bytes: int = 0
    final_put_bytes: int = 0
    state_bytes: int = 0
    downloaded_bytes: int = 0
    num_segments: int = 0
    num_parts: int = 0
    num_retries: int = 0
    num_playlist_skips: int = 0
    num_spilled: int = 0  # fragments spooled to disk while uploads were behind
    num_repaired: int = 0  # lost segment objects re-cut from the final MP4 at verification

    @property
    def media_bytes(self) -> int:
        """Everything but resume states: what the 1.01x / 2.02x budgets are measured on."""
        return self.init_bytes + self.segment_bytes + self.playlist_bytes + self.part_bytes + self.final_put_bytes


@dataclass
class _Item:
    """A fragment waiting for the upload thread; its bytes in RAM or spooled to a temp file."""

    fragment: Fragment  # with data=b"" and resume_state=None once spooled
    nbytes: int
    spool: IO[bytes] | None = None
    state_len: int = 0

    def spill(self) -> None:
        f = tempfile.TemporaryFile(prefix="longtake-backlog-")
        f.write(self.fragment.data)
        state = self.fragment.resume_state or b""
        f.write(state)
        self.state_len = len(state)
        self.spool = f
        has_state = self.fragment.resume_state is not None
        self.fragment = _replace(self.fragment, data=b"", resume_state=b"" if has_state else None)

    def load(self) -> tuple[bytes, bytes | None]:
        if self.spool is None:
            return self.fragment.data, self.fragment.resume_state
        self.spool.seek(0)
        data = self.spool.read(self.nbytes)
        state = self.spool.read(self.state_len) if self.fragment.resume_state is not None else None
        self.spool.close()
        return data, state


def _replace(f: Fragment, *, data: bytes, resume_state: bytes | None) -> Fragment:
    return Fragment(
        index=f.index, data=data, first_frame=f.first_frame, num_frames=f.num_frames, start_s=f.start_s,
        duration_s=f.duration_s, is_last=f.is_last, resume_state=resume_state,
    )


def _sink_error(message: str, *, retryable: bool = True) -> SinkError:
    err = SinkError(message)
    err.retryable = retryable
    return err


@dataclass
class _Backlog:
    items: deque[_Item] = field(default_factory=deque)
    nbytes: int = 0


class S3ProgressiveSink:
    """FrameSink that delivers fragments to an :class:`ObjectStore` as they are made (see module doc)."""

    def __init__(
        self,
        store: ObjectStore,
        prefix: str,
        *,
        committed: Sequence[SegmentRecord] = (),
        on_commit: Callable[[SegmentRecord], None],
        preview: bool = True,
        multipart_state: MultipartState | None = None,
        on_multipart: Callable[[MultipartState], None] | None = None,
        part_min_bytes: int = S3_MIN_PART_BYTES,
        max_in_memory: int = 2,
        max_backlog_bytes: int = 1024 * MIB,
        give_up_after_s: float = 120.0,
        playlist_budget: float = 0.015,
        target_duration: int | None = None,
        state_every: int = 1,
        key_tag: str = "",
        fence: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.preview = preview
        self.final_key = safe_key(prefix, FINAL_NAME)
        self.init_key = safe_key(prefix, INIT_NAME)
        self.playlist_key = safe_key(prefix, PLAYLIST_NAME)
        self.state_object_key = safe_key(prefix, MULTIPART_STATE_NAME)
        self.counters = DeliveryCounters()
        self._where = store.uri(self.final_key).rsplit("/", 1)[0] + "/"
        self._on_commit = on_commit
        self._on_multipart = on_multipart
        self._part_min = part_min_bytes
        self._max_in_memory = max(1, max_in_memory)
        self._max_backlog = max_backlog_bytes
        self._give_up_after_s = give_up_after_s
        self._playlist_budget = playlist_budget
        self._target_duration = target_duration  # HLS EXT-X-TARGETDURATION; None: first segment + 1 s
        if state_every < 1:
            raise ValueError(f"state_every={state_every}: must be >= 1")
        self._state_every = state_every  # upload the resume state of every N-th fragment only
        # Fencing object writes (issue 17 item 5): segment and state objects are named per attempt
        # (key_tag, e.g. "a2-"), so a stale attempt's late write can only create an object no
        # committed row names; and fence() (the worker's lease check) runs before every write, so a
        # worker that lost its lease writes nothing at all once it notices.
        if key_tag and ("/" in key_tag or not check_relative_key(key_tag + "x", field="key_tag")):
            raise ValueError(f"key_tag={key_tag!r}: one name prefix without '/', e.g. 'a2-'")
        self._tag = key_tag
        self._fence = fence

        done = sorted(committed, key=lambda s: s.index)
        if [s.index for s in done] != list(range(len(done))):
            raise ValueError(
                f"committed segment indices {[s.index for s in done]} are not 0..n-1; pass the job's "
                "committed segments in full"
            )
        # What the sink keeps per committed segment is compact (issue 16: a 2-hour job commits
        # ~7,000): the playlist's text (~40 bytes a segment) and, for the segments committed before
        # this attempt, their sha256 digests (32 bytes each, to check the fragments a resumed
        # render re-makes). The records of a resume are needed only until the upload thread has
        # reconciled with the store (_start), then dropped; none of this attempt's are kept.
        self._resumed: Sequence[SegmentRecord] = done
        self._resumed_sha = b"".join(bytes.fromhex(s.checksum) for s in done)
        self._playlist = bytearray()  # one hls_playlist_entry per committed segment (preview on)
        self._playlist_count = 0
        self._longest_s = 0.0
        if preview:
            for seg in done:
                self._add_to_playlist(seg.key, seg.duration_s)
        self._resume_mp = multipart_state
        self._next_write = len(done)  # next fragment index the render must write
        self._replay_next: int | None = None  # next re-rendered committed fragment expected (see write)
        self._init: InitSegment | None = None
        self._init_sha = ""

        self._cond = threading.Condition()
        self._backlog = _Backlog()
        self._closing = False
        self._close_ok = False
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

        # upload-thread state
        self._mp: MultipartState | None = None
        self._pending: list[tuple[int, bytes]] = []  # (fragment index, bytes) not yet in a part
        self._pending_bytes = 0
        self._unpart_commits: list[tuple[Fragment, str, int]] = []  # preview off: waiting for their part
        self._last_state: tuple[int, bytes] | None = None  # (fragment index, its resume state)
        self.final_uploaded_at: float | None = None
        self.last_write_at: float | None = None

    # ------------------------------------------------------------------ FrameSink (render thread)
    def open(self, init: InitSegment) -> None:
        if self._thread is not None:
            raise _sink_error("S3ProgressiveSink.open called twice; build one sink per render attempt",
                              retryable=False)
        self._init = init
        self._init_sha = hashlib.sha256(init.data).hexdigest()
        self._thread = threading.Thread(target=self._run, name=f"delivery-{self.prefix}", daemon=True)
        self._thread.start()

    def write(self, fragment: Fragment) -> None:
        if self._thread is None:
            raise _sink_error("S3ProgressiveSink.write before open()", retryable=False)
        if self._replay_next is None:
            # A resumed render restarts after the last *stored* state, which may precede the last
            # committed segment (states are kept every ``state_every`` segments).
            self._replay_next = min(fragment.index, self._next_write)
        if fragment.index < self._next_write:
            # ...so it re-makes committed fragments, byte for byte: check them, don't re-send them.
            at = 32 * fragment.index
            if (fragment.index != self._replay_next
                    or hashlib.sha256(fragment.data).digest() != self._resumed_sha[at:at + 32]):
                raise _sink_error(
                    f"re-rendered fragment {fragment.index} does not reproduce committed segment {fragment.index} "
                    "(order or checksum): the model, checkpoint or inputs changed since the job started; "
                    "resubmit the job", retryable=False)
            self._replay_next += 1
            return
        if fragment.index != self._next_write:
            raise _sink_error(
                f"fragment.index={fragment.index} but the sink expects {self._next_write} "
                f"({len(self._resumed_sha) // 32} committed on resume); render must write fragments in order",
                retryable=False,
            )
        self._next_write += 1
        self.last_write_at = time.monotonic()
        item = _Item(fragment=fragment, nbytes=len(fragment.data))
        with self._cond:
            self._raise_if_failed()
            while self._backlog.nbytes > self._max_backlog and self._failure is None:
                self._cond.wait(0.5)  # back-pressure: the backlog on disk is full
            self._raise_if_failed()
            self._backlog.items.append(item)
            self._backlog.nbytes += item.nbytes
            # keep only the newest few in RAM; an outage spools the rest to disk
            in_ram = [it for it in self._backlog.items if it.spool is None]
            for old in in_ram[: max(0, len(in_ram) - self._max_in_memory)]:
                old.spill()
                self.counters.num_spilled += 1
            self._cond.notify_all()

    def close(self, *, ok: bool) -> None:
        """Wait for the backlog to be delivered; with ``ok`` finish the MP4 and the playlist.
        Raises :class:`SinkError` if delivery failed, except with ``ok=False`` (the render's own
        error wins; the failure is logged)."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            return
        with self._cond:
            self._closing = True
            self._close_ok = ok
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            if not ok and self._failure is not None:
                # the render is already failing; its own error is the one to report
                logger.warning("delivery to %s had failed too: %s", self._where, self._failure)
                return
            self._raise_if_failed()

    # ------------------------------------------------------------------ public helpers
    @property
    def backlog_bytes(self) -> int:
        """Bytes handed to ``write`` that the upload thread has not finished with (a gauge for metrics)."""
        with self._cond:
            return self._backlog.nbytes

    @property
    def multipart_state(self) -> MultipartState | None:
        return self._mp

    def outputs(self) -> dict[str, str]:
        """URIs of the final MP4 and (preview on) the HLS playlist, for ``JobStore.finish``."""
        out = {"mp4": self.store.uri(self.final_key)}
        if self.preview:
            out["hls"] = self.store.uri(self.playlist_key)
        return out

    def verify_outputs(self, committed: Sequence[SegmentRecord]) -> str | None:
        """After ``close(ok=True)``, before the job row is marked succeeded: check that everything
        the row will claim exists — the final MP4, and with the preview the playlist (listing
        exactly the committed segments), its init segment and every segment it names — and repair
        what can be repaired: a lost segment is re-cut from the final MP4 (init + fragments in
        order, so its byte range follows from the committed sizes; checksum verified) and put back
        (fenced), a lost init segment is put again. Returns None when all is there (repaired or
        not), else the reason (the caller fails the attempt, retryable).

        One LIST of the job prefix instead of a HEAD per segment: a 2-hour job has ~11,000
        segments (11,000 HEADs vs 12 LIST pages), and S3 LIST is strongly consistent."""
        present = set(self.store.list(self.prefix))
        if self.final_key not in present:
            return f"final output {self.store.uri(self.final_key)} is missing right after its upload completed"
        if not self.preview:
            return None
        if self.playlist_key not in present:
            return f"playlist {self.store.uri(self.playlist_key)} is missing"
        listed = [ln for ln in self.store.get_bytes(self.playlist_key).decode().splitlines()
                  if ln and not ln.startswith("#")]
        want = [seg.key.rsplit("/", 1)[-1] for seg in committed]
        if listed != want:
            return (f"playlist {self.store.uri(self.playlist_key)} lists {len(listed)} segments but the job "
                    f"row has {len(want)} committed")
        if self.init_key not in present and self._init is not None:
            logger.warning("init segment %s was lost; putting it again", self.init_key)
            self._put(self.init_key, self._init.data, "init_bytes", "video/mp4")
        lost = [seg for seg in committed if seg.key not in present]
        if lost:
            return self._repair_segments(lost, committed)
        return None

    def _repair_segments(self, lost: Sequence[SegmentRecord], committed: Sequence[SegmentRecord]) -> str | None:
        assert self._init is not None
        offsets, at = {}, len(self._init.data)
        for seg in committed:
            offsets[seg.index] = at
            at += seg.nbytes
        with tempfile.TemporaryDirectory(prefix="longtake-verify-") as tmp:
            path = Path(tmp) / FINAL_NAME
            self.store.download_to(self.final_key, path)
            with open(path, "rb") as f:
                for seg in lost:
                    f.seek(offsets[seg.index])
                    data = f.read(seg.nbytes)
                    if hashlib.sha256(data).hexdigest() != seg.checksum:
                        return (f"segment {seg.key} was lost and the final MP4 does not hold its committed "
                                "bytes; the job must be rendered again")
                    self._put(seg.key, data, "segment_bytes", "video/iso.segment")
        logger.warning("%d lost segment objects re-cut from %s and put back: %s", len(lost), self.final_key,
                       ", ".join(seg.key.rsplit("/", 1)[-1] for seg in lost[:10]))
        self.counters.num_repaired += len(lost)
        return None

    def abandon(self) -> None:
        """After a job is finally given up (cancelled or failed for good): abort the multipart
        upload and remove its state; committed segments stay for the partial output."""
        mp = self._mp or self._resume_mp
        if mp is not None:
            self._abort_upload(mp)
            self.store.delete(self.state_object_key)

    def _abort_upload(self, mp: MultipartState) -> None:
        try:
            self.store.abort_multipart(mp.key, mp.upload_id)
        except ObjectNotFoundError:
            pass  # completed, aborted, or expired already

    def discard(self, stale: Sequence[SegmentRecord]) -> None:
        """Remove what an earlier render of the job left, before this sink (built with no committed
        segments) delivers a render from the beginning: the interrupted multipart upload of the final
        MP4 (aborted) and its state, the playlist listing the old segments, a final MP4 if one was
        completed, and the ``stale`` segments' objects and resume states. The worker calls it after
        the job row forgot them (``JobStore.discard_segments``), so nothing names what is deleted.
        Fenced and retried like every write; call before ``open``."""
        if self._thread is not None or self._resumed:
            raise _sink_error("S3ProgressiveSink.discard: call it on a fresh sink (no committed segments) "
                              "before open()", retryable=False)
        mp = self._load_multipart_state()
        if mp is not None:
            def abort(m: MultipartState = mp) -> None:
                self._check_fence()
                self._abort_upload(m)

            self._retry(f"abort multipart {mp.upload_id}", abort)
        keys = {self.state_object_key, self.playlist_key, self.final_key}
        keys |= {seg.key for seg in stale} | {seg.state_key for seg in stale if seg.state_key is not None}
        for key in sorted(keys):
            def remove(k: str = key) -> None:
                self._check_fence()
                self.store.delete(k)

            self._retry(f"delete {key}", remove)
        logger.info("discarded %d committed segments under %s and the upload made with them", len(stale),
                    self._where)

    # ------------------------------------------------------------------ upload thread
    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            if isinstance(self._failure, SinkError):
                raise self._failure
            raise _sink_error(f"upload to {self._where} failed: {self._failure}") from self._failure

    def _take(self) -> _Item | None:
        with self._cond:
            while not self._backlog.items and not self._closing:
                self._cond.wait()
            if not self._backlog.items:
                return None
            # popped under the lock so write() no longer spills it; still counted until _done
            return self._backlog.items.popleft()

    def _done(self, item: _Item) -> None:
        with self._cond:
            self._backlog.nbytes -= item.nbytes
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            self._start()
            while True:
                item = self._take()
                if item is None:
                    break
                data, state = item.load()
                self._deliver(item.fragment, data, state)
                self._done(item)
            if self._close_ok:
                self._finalize()
        except BaseException as exc:  # handed to the render thread on its next write/close
            logger.error("delivery to %s failed: %s", self._where, exc)
            with self._cond:
                self._failure = exc
                self._cond.notify_all()

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """Call ``fn`` until it succeeds, a non-retryable error, or ``give_up_after_s`` of failure."""
        first_failure: float | None = None
        delay = 0.5
        while True:
            try:
                return fn()
            except StorageError as exc:
                now = time.monotonic()
                first_failure = first_failure or now
                if not exc.retryable:
                    raise _sink_error(f"{what} failed: {exc}", retryable=False) from exc
                if now - first_failure >= self._give_up_after_s:
                    raise _sink_error(
                        f"{what} failed for {now - first_failure:.0f} s (give_up_after_s="
                        f"{self._give_up_after_s:g}); object store {self._where} unreachable: "
                        f"{exc}"
                    ) from exc
                self.counters.num_retries += 1
                logger.warning("%s failed (%s); retrying in %.1f s", what, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _check_fence(self) -> None:
        """Before every write (retries included): raises (LeaseLostError) once the lease is gone."""
        if self._fence is not None:
            self._fence()

    def _put(self, key: str, data: bytes, counter: str, content_type: str) -> None:
        def attempt() -> None:
            self._check_fence()
            setattr(self.counters, counter, getattr(self.counters, counter) + len(data))
            self.store.put_bytes(key, data, content_type=content_type)

        self._retry(f"put {key}", attempt)

    def _start(self) -> None:
        """Upload the init segment (preview) and reconcile with what a previous attempt left."""
        assert self._init is not None
        if self.preview:
            same = False
            if self._resumed:
                try:
                    same = hashlib.sha256(self._retry("get init", lambda: self.store.get_bytes(self.init_key))
                                          ).hexdigest() == self._init_sha
                except SinkError as exc:
                    if not isinstance(exc.__cause__, ObjectNotFoundError):
                        raise
            if not same:
                self._put(self.init_key, self._init.data, "init_bytes", "video/mp4")
        if not self._resumed:
            return
        last = self._resumed[-1].index
        mp = self._resume_mp or self._load_multipart_state()
        if mp is not None and mp.init_sha256 != self._init_sha:
            raise _sink_error(
                f"init segment differs from the one of the interrupted upload {mp.upload_id} "
                "(output settings changed between attempts?); restart the job from scratch", retryable=False,
            )
        if mp is not None:
            mp = self._verify_parts(mp, last)
        self._mp = mp
        covered = mp.parts[-1].last_index if mp and mp.parts else -1
        if covered < last and not self.preview:
            raise _sink_error(
                f"fragments {covered + 1}..{last} are committed but in no uploaded part and the preview "
                "(which would hold them) is off; restart the job from scratch", retryable=False,
            )
        # Refill the pending run from the committed preview segments (a download, not a re-upload).
        for seg in self._resumed[covered + 1:]:
            data = self._retry(f"get {seg.key}", lambda k=seg.key: self.store.get_bytes(k))  # type: ignore[misc]
            self.counters.downloaded_bytes += len(data)
            if hashlib.sha256(data).hexdigest() != seg.checksum:
                raise _sink_error(f"segment {seg.key} does not match its committed checksum; restart the job",
                                  retryable=False)
            self._add_pending(seg.index, data)
        self._resumed = ()  # reconciled: only the digests (write's replay check) are kept
        if self.preview:
            self._put_playlist(ended=False)

    def _load_multipart_state(self) -> MultipartState | None:
        try:
            raw = self._retry("get multipart state", lambda: self.store.get_bytes(self.state_object_key))
        except SinkError as exc:
            if isinstance(exc.__cause__, ObjectNotFoundError):
                return None
            raise
        return MultipartState.from_json(raw)

    def _verify_parts(self, mp: MultipartState, last_committed: int) -> MultipartState | None:
        try:
            listed = self._retry("list parts", lambda: self.store.list_parts(mp.key, mp.upload_id))
        except SinkError as exc:
            if isinstance(exc.__cause__, ObjectNotFoundError):
                logger.warning("multipart upload %s is gone; starting a new one", mp.upload_id)
                return None
            raise
        on_server = {p.part_number: p.etag for p in listed}
        keep: list[UploadedPart] = []
        for part in mp.parts:
            if on_server.get(part.part_number) != part.etag or part.last_index > last_committed:
                break
            keep.append(part)
        logger.info("resuming multipart upload %s with %d of %d parts", mp.upload_id, len(keep), len(mp.parts))
        return MultipartState(mp.key, mp.upload_id, mp.init_sha256, tuple(keep))

    def _deliver(self, fragment: Fragment, data: bytes, state: bytes | None) -> None:
        checksum = hashlib.sha256(data).hexdigest()
        if self.preview:
            key = safe_key(self.prefix, self._tag + hls_segment_name(fragment.index))
            self._put(key, data, "segment_bytes", "video/iso.segment")
            self.counters.num_segments += 1
            state_key = None
            if state is not None and fragment.index % self._state_every == 0:
                state_key = safe_key(self.prefix, f"{self._tag}state_{fragment.index:05d}.bin")
                self._put(state_key, state, "state_bytes", "application/octet-stream")
            seg = SegmentRecord(fragment.index, key, len(data), fragment.duration_s, checksum, state_key,
                                   fragment.first_frame, fragment.num_frames)
            self._add_to_playlist(key, seg.duration_s)
            self._put_playlist(ended=False, optional=True)
            self._commit(seg)
        else:
            self._unpart_commits.append((_replace(fragment, data=b"", resume_state=None), checksum, len(data)))
            if state is not None and fragment.index % self._state_every == 0:
                self._last_state = (fragment.index, state)
        self._add_pending(fragment.index, data)

    def _commit(self, seg: SegmentRecord) -> None:
        try:
            self._on_commit(seg)
        except Exception as exc:
            raise _sink_error(
                f"on_commit for segment {seg.index} failed ({type(exc).__name__}: {exc}); stopping delivery",
                retryable=False,
            ) from exc

    def _add_to_playlist(self, key: str, duration_s: float) -> None:
        if self._target_duration is None:
            # fixed by the first segment with 1 s of headroom (it must not change in an EVENT playlist)
            self._target_duration = hls_target_duration(duration_s) + 1
        self._playlist += hls_playlist_entry(key.rsplit("/", 1)[-1], duration_s).encode()
        self._playlist_count += 1
        self._longest_s = max(self._longest_s, duration_s)

    def _put_playlist(self, *, ended: bool, optional: bool = False) -> None:
        target = max(self._target_duration or 1, hls_target_duration(self._longest_s))
        if self._target_duration is not None and target > self._target_duration:
            logger.warning("segment of %.3f s exceeds the HLS target duration %d; raising it", self._longest_s,
                           self._target_duration)
            self._target_duration = target
        head = hls_playlist_head(target, INIT_NAME).encode()
        tail = HLS_ENDLIST.encode() if ended else b""
        if optional and self._playlist_count > 1:
            # Each rewrite re-sends the whole list (O(n^2) bytes over a render). Stay within
            # playlist_budget of the segment bytes: every segment for ordinary sizes, thinning out
            # only for very long, low-bitrate renders (keeps the 2.02x upload bound).
            budget = self._playlist_budget * self.counters.segment_bytes
            if self.counters.playlist_bytes + len(head) + len(self._playlist) + len(tail) > budget:
                self.counters.num_playlist_skips += 1
                return
        self._put(self.playlist_key, head + bytes(self._playlist) + tail, "playlist_bytes",
                  "application/vnd.apple.mpegurl")

    def _add_pending(self, index: int, data: bytes) -> None:
        self._pending.append((index, data))
        self._pending_bytes += len(data)
        head = len(self._init.data) if self._init and not (self._mp and self._mp.parts) else 0
        if head + self._pending_bytes >= self._part_min:
            self._upload_part()

    def _upload_part(self) -> None:
        assert self._init is not None and self._pending
        if self._mp is None:
            def create() -> str:
                self._check_fence()
                return self.store.create_multipart(self.final_key, content_type="video/mp4")

            upload_id = self._retry("create multipart", create)
            self._mp = MultipartState(self.final_key, upload_id, self._init_sha)
        mp = self._mp
        first_part = not mp.parts
        body = (self._init.data if first_part else b"") + b"".join(d for _, d in self._pending)
        part_number = len(mp.parts) + 1

        def attempt() -> str:
            self._check_fence()
            self.counters.part_bytes += len(body)
            return self.store.upload_part(mp.key, mp.upload_id, part_number, body)

        etag = self._retry(f"upload part {part_number} of {mp.key}", attempt)
        self.counters.num_parts += 1
        part = UploadedPart(part_number, etag, self._pending[0][0], self._pending[-1][0], len(body))
        self._mp = MultipartState(mp.key, mp.upload_id, mp.init_sha256, (*mp.parts, part))
        self._pending, self._pending_bytes = [], 0
        self._put(self.state_object_key, self._mp.to_json(), "state_bytes", "application/json")
        if self._on_multipart is not None:
            self._on_multipart(self._mp)
        self._commit_unparted()

    def _commit_unparted(self) -> None:
        """Preview off: fragments become durable when the part (or final put) carrying them lands."""
        if not self._unpart_commits:
            return
        state_key, state_index = None, -1
        if self._last_state is not None:
            state_index, state = self._last_state
            state_key = safe_key(self.prefix, f"{self._tag}state_{state_index:05d}.bin")
            self._put(state_key, state, "state_bytes", "application/octet-stream")
            self._last_state = None
        for frag, checksum, nbytes in self._unpart_commits:
            seg = SegmentRecord(frag.index, self.final_key, nbytes, frag.duration_s, checksum,
                                   state_key if frag.index == state_index else None, frag.first_frame,
                                   frag.num_frames)
            self._commit(seg)
        self._unpart_commits = []

    def _finalize(self) -> None:
        assert self._init is not None
        if self._mp is None:
            body = self._init.data + b"".join(d for _, d in self._pending)
            self._put(self.final_key, body, "final_put_bytes", "video/mp4")
            self._pending, self._pending_bytes = [], 0
        else:
            if self._pending:
                self._upload_part()
            mp = self._mp
            parts = [(p.part_number, p.etag) for p in mp.parts]
            tried = False

            def complete() -> None:
                nonlocal tried
                self._check_fence()
                try:
                    self.store.complete_multipart(mp.key, mp.upload_id, parts)
                except ObjectNotFoundError:
                    # a retried complete whose first attempt landed finds the upload gone
                    if not (tried and self.store.exists(mp.key)):
                        raise
                finally:
                    tried = True

            self._retry(f"complete multipart {mp.key}", complete)
            self._retry("delete multipart state", lambda: self.store.delete(self.state_object_key))
        self.final_uploaded_at = time.monotonic()
        self._commit_unparted()
        if self.preview:
            self._put_playlist(ended=True)
