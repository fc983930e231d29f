"""A stand-in for ``pipeline.render`` with the same signature, for the job/worker integration tests.

Deterministic: fragment ``i`` of seed ``s`` depends on a rolling hash state carried from fragment 0,
so resuming from the wrong state gives different bytes (the resume tests can fail). It sleeps
``sleep_s`` per chunk, honours ``resume_state`` / ``should_cancel`` / ``on_progress`` exactly as the
contract says, and appends one line per fragment it produces to ``$LONGTAKE_FAKE_RENDER_LOG`` (the
render counter). ``request.options`` are checked by the family as ``render()`` checks them, and each
call's request (seed, family, preset, options) is appended to ``$LONGTAKE_FAKE_REQUEST_LOG`` when set.

The "audio" input is a small JSON file describing the render: ``{"num_fragments": 6,
"sleep_s": 0.2, "fail_at": null, "fail_code": null}``. The image input is only checked to exist.

Live sessions (``request.live``): the "audio" is a live directory (:mod:`pipeline.live`), followed
as the real render does: one fragment per :data:`LIVE_SPAN_S` of timeline (10 frames at 25 fps),
emitted as soon as the audio it needs has arrived (default latency: its span plus one more span of
look-ahead; ``use_i_chunks=False``: its span only), until ``end.json``; the last fragment covers the
rest (short). ``RenderProgress.audio_delay_s`` = publication time minus the arrival (``t`` in
``index.jsonl``) of the last audio frame the fragment needed. With ``$LONGTAKE_FAKE_LIVE_MEDIA=1``
the fragments are real fMP4 (H.264 + AAC, :func:`delivery_media.make_sample`, one 10-frame GOP per
fragment), so a browser can play the session (the preview page test).

Also here: :func:`hanging_delivery`, the worker's real delivery with a sink that hangs once (the
``hanging`` app of ``celery_apps.py`` injects it into ``JobWorker``), and
:func:`real_render_crashing_once`, the real pipeline whose first attempt dies after a few commits.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import (
    CancelledError,
    InvalidInputError,
    OutOfMemoryError,
    RenderError,
    ResumeStateError,
    SinkError,
)
from pipeline.families import FAMILIES
from pipeline.media_types import Fragment, FrameSink, InitSegment
from pipeline.request import RenderProgress, RenderRequest, RenderResult

FPS = 25
FRAMES_PER_FRAGMENT = 10
FRAGMENT_BYTES = 1024


def write_plan(
    path: Path,
    *,
    num_fragments: int,
    sleep_s: float,
    fail_at: int | None = None,
    fail_code: str | None = None,
    hang_at: int | None = None,
    hang_once: Path | None = None,
    as_wav: bool = False,
    fragment_bytes: int = FRAGMENT_BYTES,
    state_bytes: int = 0,
) -> Path:
    """Write the JSON 'audio' file that drives the fake render. ``hang_at``: before that fragment
    the render goes silent for an hour (a deadlocked rank), only while the file ``hang_once`` does
    not exist yet (it is created when the hang starts), so a retry runs through. ``as_wav``: a real
    (silent, 1 s) WAV file that carries the plan in a chunk of its own, for paths that probe the
    audio before the render (the API's upload check). ``fragment_bytes`` / ``state_bytes``: the size
    of each fragment's media and the padding of its resume state (a real tiny job's: ~36 kB and
    ~1.25 MB), for the memory profiles of the worker path."""
    plan = json.dumps(
        {
            "num_fragments": num_fragments,
            "sleep_s": sleep_s,
            "fail_at": fail_at,
            "fail_code": fail_code,
            "hang_at": hang_at,
            "hang_once": str(hang_once) if hang_once else None,
            "fragment_bytes": fragment_bytes,
            "state_bytes": state_bytes,
        }
    ).encode()
    if not as_wav:
        path.write_bytes(plan)
        return path
    fmt = struct.pack("<HHIIHH", 1, 1, 8000, 8000, 1, 8)  # PCM, mono, 8 kHz, 8 bit
    plan += b" " * (len(plan) % 2)  # RIFF chunks are padded to an even size
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", 8000) + bytes([128]) * 8000
    body += _PLAN_CHUNK + struct.pack("<I", len(plan)) + plan
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)
    return path


_PLAN_CHUNK = b"ltpl"


def read_plan(path: Path) -> dict[str, Any]:
    """The plan :func:`write_plan` wrote (plain JSON, or the plan chunk of its WAV)."""
    data = path.read_bytes()
    if data.startswith(b"RIFF"):
        at = data.index(_PLAN_CHUNK) + 4
        (size,) = struct.unpack("<I", data[at : at + 4])
        data = data[at + 4 : at + 4 + size]
    plan: dict[str, Any] = json.loads(data)
    return plan


def _hang_once(marker: str | None) -> None:
    """Sleep for an hour the first time ``marker`` is seen absent (creating it); else return."""
    if marker is None:
        return
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    time.sleep(3600)


def init_segment(seed: int) -> InitSegment:
    return InitSegment(
        data=b"FAKEINIT" + seed.to_bytes(8, "big") * 8,
        width=64,
        height=64,
        fps=FPS,
        sample_rate=16000,
        video_codec="avc1.64001e",
        audio_codec="mp4a.40.2",
    )


def _start_state(seed: int) -> bytes:
    return hashlib.sha256(f"longtake-fake-{seed}".encode()).digest()


def _fragment(
    seed: int, index: int, acc: bytes, num_fragments: int, size: int = FRAGMENT_BYTES, state_bytes: int = 0
) -> tuple[Fragment, bytes]:
    block = hashlib.sha256(acc + index.to_bytes(8, "big")).digest()
    data = (block * (size // len(block) + 1))[:size]
    acc = hashlib.sha256(acc + data).digest()
    st: dict[str, Any] = {"seed": seed, "next": index + 1, "acc": acc.hex()}
    if state_bytes:
        st["pad"] = "s" * state_bytes
    state = json.dumps(st).encode()
    frag = Fragment(
        index=index,
        data=data,
        first_frame=index * FRAMES_PER_FRAGMENT,
        num_frames=FRAMES_PER_FRAGMENT,
        start_s=index * FRAMES_PER_FRAGMENT / FPS,
        duration_s=FRAMES_PER_FRAGMENT / FPS,
        is_last=index == num_fragments - 1,
        resume_state=state,
    )
    return frag, acc


def expected_output(seed: int, num_fragments: int) -> bytes:
    """init + every fragment of an uninterrupted render, computed without sleeping."""
    out = [init_segment(seed).data]
    acc = _start_state(seed)
    for i in range(num_fragments):
        frag, acc = _fragment(seed, i, acc, num_fragments)
        out.append(frag.data)
    return b"".join(out)


def _count(seed: int, index: int) -> None:
    path = os.environ.get("LONGTAKE_FAKE_RENDER_LOG")
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{seed} {index} {os.getpid()}\n".encode())
        finally:
            os.close(fd)


def _log_request(request: RenderRequest) -> None:
    """One JSON line per render call, ``{"seed", "family", "preset", "options"}``, appended to
    ``$LONGTAKE_FAKE_REQUEST_LOG`` when it is set: what reached the rank's renderer."""
    path = os.environ.get("LONGTAKE_FAKE_REQUEST_LOG")
    if path:
        line = json.dumps({"seed": request.seed, "family": request.family, "preset": request.preset,
                           "options": dict(request.options)})
        with open(path, "a") as f:
            f.write(line + "\n")


LIVE_SPAN_S = FRAMES_PER_FRAGMENT / FPS


def _render_live(
    request: RenderRequest,
    sinks: Sequence[FrameSink],
    should_cancel: Callable[[], bool] | None,
    on_progress: Callable[[RenderProgress], None] | None,
) -> RenderResult:
    t0 = time.monotonic()
    live = Path(request.audio)
    meta = json.loads((live / "meta.json").read_text())
    rate = int(meta["sample_rate"])
    span = int(rate * LIVE_SPAN_S)
    look = span if request.use_i_chunks else 0
    seed = request.seed
    acc = _start_state(seed)
    arrivals: list[tuple[int, float]] = []  # (timeline frames, arrival unix time) per index line
    index_at = 0
    i = 0
    num_frames = 0
    ttff = 0.0
    media = None
    if os.environ.get("LONGTAKE_FAKE_LIVE_MEDIA") == "1":
        from delivery_media import make_sample

        media = make_sample(20.0, gop=FRAMES_PER_FRAGMENT, size=64)
    for s in sinks:
        s.open(media.init if media is not None else init_segment(seed))
    try:
        while True:
            if should_cancel is not None and should_cancel():
                raise CancelledError(f"cancelled before fragment {i}")
            end = json.loads((live / "end.json").read_text()) if (live / "end.json").exists() else None
            with open(live / "index.jsonl", "rb") as f:  # end.json is written after the last line
                f.seek(index_at)
                chunk = f.read()
            lines = chunk[: chunk.rfind(b"\n") + 1]
            index_at += len(lines)
            arrivals += [(int(e["end"]), float(e["t"])) for e in map(json.loads, lines.splitlines())]
            have = arrivals[-1][0] if arrivals else 0
            total = int(end["frames"]) if end is not None else None
            if total is not None and i * span >= total:
                break
            upto = (i + 1) * span if total is None else min((i + 1) * span, total)
            needed = upto + look if total is None else min(upto + look, total)
            if have < needed:
                time.sleep(0.02)
                continue
            frames = -(-(upto - i * span) * FPS // rate)  # video frames of this span, rounded up
            block = hashlib.sha256(acc + i.to_bytes(8, "big")).digest()
            data = (block * (FRAGMENT_BYTES // len(block) + 1))[:FRAGMENT_BYTES]
            acc = hashlib.sha256(acc + data).digest()
            if media is not None:
                data = media.fragments[i % len(media.fragments)].data
            frag = Fragment(index=i, data=data, first_frame=num_frames, num_frames=frames,
                            start_s=num_frames / FPS, duration_s=frames / FPS,
                            is_last=total is not None and upto >= total, resume_state=None)
            _count(seed, i)
            for s in sinks:
                s.write(frag)
            num_frames += frames
            if not ttff:
                ttff = time.monotonic() - t0
            arrived = next(t for end_frames, t in arrivals if end_frames >= needed)
            if on_progress is not None:
                on_progress(RenderProgress(emission_index=i, num_emissions=i + 1, frames_done=num_frames,
                                           num_frames=num_frames, elapsed_s=time.monotonic() - t0,
                                           audio_delay_s=time.time() - arrived))
            i += 1
    except BaseException:
        for s in sinks:
            s.close(ok=False)
        raise
    for s in sinks:
        s.close(ok=True)
    return RenderResult(num_frames=num_frames, duration_s=num_frames / FPS, ttff_s=ttff,
                        wall_s=time.monotonic() - t0, peak_rss_bytes=0, num_fragments=i)


def render(
    request: RenderRequest,
    sinks: Sequence[FrameSink],
    *,
    mode: str = "streaming",
    resume_state: bytes | None = None,
    should_cancel: Callable[[], bool] | None = None,
    on_progress: Callable[[RenderProgress], None] | None = None,
    device: str = "cpu",
    family: object | None = None,
) -> RenderResult:
    t0 = time.monotonic()
    if not Path(request.image).is_file():
        raise InvalidInputError(f"image: {request.image} does not exist", field="image")
    # the family's options, checked as render() checks them (a stale option fails the job here)
    fam = FAMILIES.get(request.family)
    fam.options(fam.preset(request.preset), request.options)
    _log_request(request)
    if request.live:
        return _render_live(request, sinks, should_cancel, on_progress)
    plan = read_plan(Path(request.audio))
    n, sleep_s = int(plan["num_fragments"]), float(plan["sleep_s"])
    seed = request.seed
    start, acc = 0, _start_state(seed)
    if resume_state is not None:
        st = json.loads(resume_state)
        if st["seed"] != seed:  # as render() refuses a snapshot of another key: the worker starts over
            raise ResumeStateError(f"resume_state is for seed {st['seed']}, not {seed}", differs=("seed",))
        start, acc = int(st["next"]), bytes.fromhex(st["acc"])
    for s in sinks:
        s.open(init_segment(seed))
    ttff = 0.0
    try:
        for i in range(start, n):
            if should_cancel is not None and should_cancel():
                raise CancelledError(f"cancelled before fragment {i}")
            time.sleep(sleep_s)
            if plan.get("hang_at") == i:
                _hang_once(plan.get("hang_once"))
            if plan.get("fail_at") == i:
                code = plan.get("fail_code") or "invalid_input"
                err: RenderError = (
                    OutOfMemoryError("fake OOM")
                    if code == "out_of_memory"
                    else InvalidInputError(f"fake bad input at fragment {i}", field="audio")
                )
                raise err
            frag, acc = _fragment(seed, i, acc, n, int(plan.get("fragment_bytes", FRAGMENT_BYTES)),
                                  int(plan.get("state_bytes", 0)))
            _count(seed, i)
            for s in sinks:
                s.write(frag)
            if not ttff:
                ttff = time.monotonic() - t0
            if on_progress is not None:
                on_progress(
                    RenderProgress(
                        emission_index=i,
                        num_emissions=n,
                        frames_done=(i + 1) * FRAMES_PER_FRAGMENT,
                        num_frames=n * FRAMES_PER_FRAGMENT,
                        elapsed_s=time.monotonic() - t0,
                    )
                )
    except BaseException:
        for s in sinks:
            s.close(ok=False)
        raise
    for s in sinks:
        s.close(ok=True)
    return RenderResult(
        num_frames=n * FRAMES_PER_FRAGMENT,
        duration_s=n * FRAMES_PER_FRAGMENT / FPS,
        ttff_s=ttff,
        wall_s=time.monotonic() - t0,
        peak_rss_bytes=0,
    )


# ------------------------------------------------------------------------------- the real render
class _CrashingSink:
    """Forwards to ``sink``; its ``write`` of fragment ``index`` fails (retryable) once: when the file
    ``marker`` does not exist yet (it is created then), so the retry runs through."""

    def __init__(self, sink: FrameSink, index: int, marker: str) -> None:
        self.sink, self.index, self.marker = sink, index, marker

    def open(self, init: InitSegment) -> None:
        self.sink.open(init)

    def write(self, fragment: Fragment) -> None:
        if fragment.index == self.index and not os.path.exists(self.marker):
            Path(self.marker).touch()
            raise SinkError(f"injected: the attempt dies at fragment {self.index} (after {self.index} commits)")
        self.sink.write(fragment)

    def close(self, *, ok: bool) -> None:
        self.sink.close(ok=ok)


def real_render_crashing_once(request: RenderRequest, sinks: Sequence[FrameSink], **kw: Any) -> RenderResult:
    """``pipeline.render.render`` (the real pipeline) whose attempt fails at one fragment, once:
    ``$LONGTAKE_FAKE_RENDER_CRASH`` = ``"index:marker-path"``, read in the rank (set it before the
    worker's ranks start). Fragments before ``index`` reach the worker and are committed with their
    resume states; the failure is retryable, so the job is requeued (the retry tests of
    test_jobs_crash.py)."""
    from pipeline.render import render as real_render

    index, _, marker = os.environ["LONGTAKE_FAKE_RENDER_CRASH"].partition(":")
    return real_render(request, [_CrashingSink(sink, int(index), marker) for sink in sinks], **kw)


# ------------------------------------------------------------------------------------------ delivery
class _HangingSink:
    """Forwards to ``sink``, but its ``write`` of fragment ``index`` never returns (once)."""

    def __init__(self, sink: FrameSink, index: int, marker: str) -> None:
        self.sink, self.index, self.marker = sink, index, marker

    def open(self, init: InitSegment) -> None:
        self.sink.open(init)

    def write(self, fragment: Fragment) -> None:
        if fragment.index == self.index:
            _hang_once(self.marker)
        self.sink.write(fragment)

    def close(self, *, ok: bool) -> None:
        self.sink.close(ok=ok)


def hanging_delivery(settings: Any, **kw: Any) -> Any:
    """The worker's real delivery whose sinks hang in ``write`` of one fragment, once:
    ``$LONGTAKE_FAKE_SINK_HANG`` = ``"index:marker-path"`` (a stuck upload in the worker thread)."""
    from worker.delivery.job_delivery import s3_delivery

    delivery = s3_delivery(settings, **kw)
    index, _, marker = os.environ["LONGTAKE_FAKE_SINK_HANG"].partition(":")
    delivery.sinks = [_HangingSink(sink, int(index), marker) for sink in delivery.sinks]
    return delivery
