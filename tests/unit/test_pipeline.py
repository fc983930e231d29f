"""The streaming pipeline on the tiny preset: streaming == batch, resume == uninterrupted, MP4 valid."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
import torch

from bench.inputs import DEMO_IMAGE
from pipeline.errors import CancelledError, PipelineBuildError, ResumeStateError
from pipeline.families import FAMILIES
from pipeline.family_runtime import WARM_FAMILIES, FamilyRuntime
from pipeline.inputs import load_reference_image
from pipeline.media_types import Fragment, InitSegment
from pipeline.render import RenderRequest, render, resume_key
from pipeline.sinks import FileSink
from pipeline.state import SNAPSHOT_VERSION
from pipeline.weights_identity import weights_identity
from tests.weights_support import other_weights

R = TypeVar("R")


class RecordingSink:
    def __init__(self) -> None:
        self.init: InitSegment | None = None
        self.fragments: list[Fragment] = []
        self.closed: bool | None = None

    def open(self, init: InitSegment) -> None:
        self.init = init

    def write(self, fragment: Fragment) -> None:
        self.fragments.append(fragment)

    def close(self, *, ok: bool) -> None:
        self.closed = ok


def _frames(request: RenderRequest, mode: str = "streaming", **kw: object) -> tuple[np.ndarray, RecordingSink]:
    parts: list[tuple[int, np.ndarray]] = []
    sink = RecordingSink()
    render(request, [sink], mode=mode, frame_tap=lambda f0, fr: parts.append((f0, fr.copy())), **kw)  # type: ignore[arg-type]
    parts.sort(key=lambda p: p[0])
    return np.concatenate([p[1] for p in parts]), sink


def test_streaming_equals_batch(speech) -> None:  # type: ignore[no-untyped-def]
    # 2.6 s at 25 fps = 65 frames: N0 N1 I0 N2 I1 N3 I2 N4 (a one-frame last chunk, no I3)
    request = RenderRequest(image=DEMO_IMAGE, audio=speech(2.6), seed=3)
    streamed, s_sink = _frames(request, "streaming")
    batched, b_sink = _frames(request, "batch")
    assert streamed.shape == batched.shape == (65, 256, 256, 3)
    diff = np.abs(streamed.astype(np.int16) - batched.astype(np.int16))
    assert diff.max() <= 1, f"max difference {diff.max()}"
    assert diff.mean() < 1e-3
    assert [f.index for f in s_sink.fragments] == [f.index for f in b_sink.fragments] == list(range(5))
    assert s_sink.closed is True and b_sink.closed is True


def test_same_seed_same_video_other_seed_other_video(speech) -> None:  # type: ignore[no-untyped-def]
    audio = speech(0.8)
    a, _ = _frames(RenderRequest(image=DEMO_IMAGE, audio=audio, seed=1))
    b, _ = _frames(RenderRequest(image=DEMO_IMAGE, audio=audio, seed=1))
    c, _ = _frames(RenderRequest(image=DEMO_IMAGE, audio=audio, seed=2))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_resume_from_any_emission_equals_uninterrupted(speech) -> None:  # type: ignore[no-untyped-def]
    request = RenderRequest(image=DEMO_IMAGE, audio=speech(2.0), seed=5)  # 50 frames, 4 emissions
    full, sink = _frames(request)
    assert len(sink.fragments) == 4
    # after N0 the state has no left anchor yet; from then on its size is bounded by the chunk shape
    # (the snapshot after I1 + N3 holds N3, the 2-frame last chunk, as the last N chunk: smaller)
    sizes = [len(f.resume_state or b"") for f in sink.fragments[:-1]]
    assert sizes[0] <= sizes[1] == max(sizes) < 4 * 2**20, f"snapshot must be small and bounded: {sizes}"
    for j in (0, 2):
        state = sink.fragments[j].resume_state
        assert state is not None
        rest, resumed = _frames(request, resume_state=state)
        assert [f.index for f in resumed.fragments] == list(range(j + 1, 4))
        first = sink.fragments[j + 1].first_frame
        assert np.array_equal(rest, full[first:])
        assert [f.data for f in resumed.fragments] == [f.data for f in sink.fragments[j + 1 :]]
        assert resumed.init is not None and sink.init is not None and resumed.init.data == sink.init.data
    assert sink.fragments[-1].is_last and sink.fragments[-1].resume_state is None


def test_resume_key_differs_by_option_weights_seed_text_and_nothing_else(speech, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    family = FAMILIES.get("tiny")
    preset = family.preset("tiny")
    shipped = family.default_checkpoint(preset)
    assert shipped is not None
    copy = tmp_path / "elsewhere.safetensors"  # the same file downloaded to another node
    shutil.copyfile(shipped, copy)
    os.utime(copy, (1, 1))
    other = other_weights(shipped, tmp_path / "other.safetensors")
    with open(shipped, "rb") as a, open(other, "rb") as b:  # only the weights differ, not the header
        n = int.from_bytes(a.read(8), "little")
        assert b.read(8 + n)[8:] == a.read(n) and os.path.getsize(other) == os.path.getsize(shipped)
    request = RenderRequest(image=DEMO_IMAGE, audio=speech(0.8), seed=3, text="a person talking")
    reference = load_reference_image(DEMO_IMAGE, preset.height, preset.width)
    runtime = FamilyRuntime(family, preset, shipped)
    options = family.options(preset, {})

    def differs(request: RenderRequest = request, runtime: FamilyRuntime = runtime,
                options: dict[str, str | int | float] = options) -> list[str]:
        a, b = resume_key(request, runtime, options, reference), key
        return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))

    key = resume_key(request, runtime, options, reference)
    assert {"family", "preset", "preset_config", "weights", "options.steps", "options.audio_guidance", "seed",
            "text", "reference"} <= set(key)
    assert differs() == []
    assert differs(runtime=FamilyRuntime(family, preset, copy)) == []  # content, not path or mtime
    assert differs(options=family.options(preset, {"steps": preset.num_steps})) == []  # as resolved
    assert differs(options=family.options(preset, {"steps": 3})) == ["options.steps"]
    # the tiny preset has no peak: the resolved peak follows the guidance
    assert differs(options=family.options(preset, {"audio_guidance": 1.0})) == ["options.audio_guidance",
                                                                               "options.audio_guidance_peak"]
    assert differs(options=family.options(preset, {"audio_guidance_peak": 7})) == ["options.audio_guidance_peak"]
    assert differs(runtime=FamilyRuntime(family, preset, other)) == ["weights"]
    assert differs(runtime=FamilyRuntime(family, preset, None)) == ["weights"]  # random init
    assert differs(request=dataclasses.replace(request, seed=4)) == ["seed"]
    assert differs(request=dataclasses.replace(request, text="a person singing")) == ["text"]
    # a release directory (the wan family's): every file by relative path, hidden ones (downloaders'
    # caches) left out
    release = tmp_path / "release"
    (release / "dit").mkdir(parents=True)
    (release / ".cache").mkdir()
    shutil.copyfile(shipped, release / "dit" / "model.safetensors")
    (release / "config.json").write_text('{"dim": 128}')
    (release / ".cache" / "download.lock").write_text("1")
    ident = weights_identity(release)
    (release / ".cache" / "download.lock").write_text("2")
    assert weights_identity(release) == ident
    (release / "config.json").write_text('{"dim": 129}')
    assert weights_identity(release) != ident
    (release / "config.json").write_text('{"dim": 128}')
    shutil.copyfile(other, release / "dit" / "model.safetensors")
    assert weights_identity(release) != ident
    # the cost: one small read per tensor, whatever the checkpoint's size
    t0 = time.perf_counter()
    weights_identity(shipped)
    assert time.perf_counter() - t0 < 0.5


def test_restore_refuses_a_snapshot_of_another_render_naming_what_differs(speech, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    request = RenderRequest(image=DEMO_IMAGE, audio=speech(2.0), seed=5)  # tiny preset: 5 steps by default
    _, sink = _frames(request)
    state = sink.fragments[1].resume_state
    assert state is not None
    shipped = FAMILIES.get("tiny").default_checkpoint(FAMILIES.get("tiny").preset("tiny"))
    assert shipped is not None
    other = other_weights(shipped, tmp_path / "other.safetensors")
    old = torch.load(io.BytesIO(state), weights_only=True)
    old["version"] = SNAPSHOT_VERSION - 1
    old_state = io.BytesIO()
    torch.save(old, old_state)

    def refusal(request: RenderRequest, state: bytes) -> ResumeStateError:
        untouched = RecordingSink()
        with pytest.raises(ResumeStateError) as err:
            render(request, [untouched], resume_state=state)
        assert untouched.init is None and untouched.fragments == []  # refused before anything is published
        assert err.value.field == "resume_state" and err.value.code == "resume_mismatch"
        assert "render from the beginning without resume_state" in str(err.value)
        return err.value

    err = refusal(dataclasses.replace(request, options={"steps": 3}), state)
    assert err.differs == ("options.steps",)
    assert "the options (options.steps: 5 in the snapshot, 3 now)" in str(err)
    err = refusal(dataclasses.replace(request, checkpoint=other), state)
    assert err.differs == ("weights",) and "the model (weights: '" in str(err)
    err = refusal(dataclasses.replace(request, checkpoint=other, options={"steps": 3}), state)
    assert err.differs == ("options.steps", "weights")
    assert refusal(dataclasses.replace(request, audio=speech(2.6)), state).differs == ("plan",)
    assert refusal(dataclasses.replace(request, seed=6), state).differs == ("seed",)
    assert refusal(request, old_state.getvalue()).differs == ("version",)
    assert refusal(request, b"not a snapshot").differs == ("unreadable",)
    # the same render (a checkpoint given by path is the one used by default) resumes
    _, resumed = _frames(dataclasses.replace(request, checkpoint=shipped), resume_state=state)
    assert [f.data for f in resumed.fragments] == [f.data for f in sink.fragments[2:]]


def test_cancel_between_chunks_closes_sinks_not_ok(speech) -> None:  # type: ignore[no-untyped-def]
    request = RenderRequest(image=DEMO_IMAGE, audio=speech(2.0))
    sink = RecordingSink()
    calls = {"n": 0}

    def cancel_after_two_steps() -> bool:
        calls["n"] += 1
        return calls["n"] > 2

    with pytest.raises(CancelledError):
        render(request, [sink], should_cancel=cancel_after_two_steps)
    assert sink.closed is False
    assert len(sink.fragments) <= 1


def test_mp4_decodes_with_ffprobe_and_matches_audio_duration(speech, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    seconds = 1.93
    out = tmp_path / "out.mp4"
    result = render(RenderRequest(image=DEMO_IMAGE, audio=speech(seconds)), [FileSink(out)])
    assert out.is_file() and not Path(str(out) + ".partial").exists()
    probe = json.loads(subprocess.run(
        ["ffprobe", "-v", "error", "-show_streams", "-show_format", "-of", "json", str(out)],
        check=True, capture_output=True, text=True).stdout)
    kinds = {s["codec_type"]: s for s in probe["streams"]}
    assert kinds["video"]["codec_name"] == "h264" and kinds["audio"]["codec_name"] == "aac"
    assert (int(kinds["video"]["width"]), int(kinds["video"]["height"])) == (256, 256)
    assert abs(float(probe["format"]["duration"]) - seconds) <= 1 / 25 + 1e-3
    decoded = subprocess.run(["ffmpeg", "-v", "error", "-i", str(out), "-f", "null", "-"],
                             capture_output=True, text=True)
    assert decoded.returncode == 0 and decoded.stderr == ""
    count = subprocess.run(["ffprobe", "-v", "error", "-count_frames", "-select_streams", "v:0",
                            "-show_entries", "stream=nb_read_frames", "-of", "csv=p=0", str(out)],
                           check=True, capture_output=True, text=True).stdout.strip()
    assert int(count) == result.num_frames == 49


def _warm_tiny() -> FamilyRuntime:
    """The runtime ``render()`` uses for a default request (the tiny family's tiny preset)."""
    return WARM_FAMILIES.get(FAMILIES.get("tiny"), "tiny")


def test_pipeline_rejects_unwired_stage() -> None:
    from pipeline.families.tiny import ports as P
    from pipeline.pipeline import Pipeline
    from pipeline.stage import Phase, Stage, Values

    class Orphan(Stage):
        name = "orphan"
        phase = Phase.EMISSION
        inputs = (P.EMISSION_HR,)
        outputs = (P.FRAMES,)

        def run(self, values: Values) -> None:  # pragma: no cover - never runs
            pass

    with pytest.raises(PipelineBuildError, match="emission_hr"):
        Pipeline([Orphan()])


def test_emission_stage_may_not_read_step_chunk_values() -> None:
    from pipeline.families.tiny import ports as P
    from pipeline.pipeline import Pipeline
    from pipeline.stage import Phase, Stage, Values

    class PeeksAtAudio(Stage):  # would race with the next step on the emission lane
        name = "peek"
        phase = Phase.EMISSION
        inputs = (P.AUDIO_FEATS,)
        outputs = ()

        def run(self, values: Values) -> None:  # pragma: no cover - never runs
            pass

    with pytest.raises(PipelineBuildError, match="emission stage 'peek' reads 'audio_feats'"):
        Pipeline([*_warm_tiny().pipeline.stages, PeeksAtAudio()])


def test_overlapped_emissions_equal_the_sequential_loop(speech) -> None:  # type: ignore[no-untyped-def]
    import threading

    family = _warm_tiny()
    assert family.overlap_emissions  # a local family overlaps SR + decode with the next step
    request = RenderRequest(image=DEMO_IMAGE, audio=speech(2.0), seed=7)
    threads: set[str] = set()
    overlapped, o_sink = _frames(request)
    parts: list[np.ndarray] = []
    render(request, [RecordingSink()],
           frame_tap=lambda f0, fr: (threads.add(threading.current_thread().name), parts.append(fr.copy())))
    assert threads == {"longtake-emission"}
    family.overlap_emissions = False
    try:
        sequential, s_sink = _frames(request)
        threads.clear()
        render(request, [RecordingSink()], frame_tap=lambda f0, fr: threads.add(threading.current_thread().name))
        assert threads == {threading.current_thread().name}
    finally:
        family.overlap_emissions = True
    assert np.array_equal(overlapped, sequential)
    # the same bytes, resume snapshots included (they are taken as of each emission's step)
    assert [(f.data, f.resume_state) for f in o_sink.fragments] == [(f.data, f.resume_state) for f in s_sink.fragments]


def test_audio_guidance_is_wired_and_off_means_one_forward(speech) -> None:  # type: ignore[no-untyped-def]
    import dataclasses

    from models.presets import get_preset
    from pipeline.families.tiny import ports as P

    tiny = get_preset("tiny")
    assert tiny.audio_guidance == 2.0
    request = RenderRequest(image=DEMO_IMAGE, audio=speech(0.64), seed=2)
    frames = {}
    for g in (1.0, 3.0):
        tiny_family = FAMILIES.get("tiny")
        family = FamilyRuntime(tiny_family, dataclasses.replace(tiny, audio_guidance=g),
                               tiny_family.default_checkpoint(tiny))
        seen: list[object] = []
        a2v = family.pipeline.step_stages[1]
        prepare = a2v.prepare  # type: ignore[attr-defined]

        def spy(values, prepare=prepare, seen=seen):  # type: ignore[no-untyped-def]
            seen.append(values.get_optional(P.AUDIO_FEATS_SILENT))
            return prepare(values)

        a2v.prepare = spy  # type: ignore[attr-defined]
        parts: list[np.ndarray] = []
        render(request, [RecordingSink()], family=family,
               frame_tap=lambda f0, fr, parts=parts: parts.append(fr.copy()))
        frames[g] = np.concatenate(parts)
        if g == 1.0:
            assert seen and all(s is None for s in seen)  # no silence features, one forward per step
        else:  # silence over each step's window, as many frames as the window
            assert seen and all(isinstance(s, torch.Tensor) and s.shape[1] in (16, 17) for s in seen)
    assert frames[1.0].shape == frames[3.0].shape
    assert not np.array_equal(frames[1.0], frames[3.0])


def render_batched_and_sequential(runtime: FamilyRuntime, dit: torch.nn.Module, render_once: Callable[[], R]
                                  ) -> tuple[dict[str, R], dict[str, list[tuple[int, tuple[int, ...] | None]]]]:
    """``render_once()`` with the runtime's batched steps, then with the sequential loop; each run's
    result and its DiT calls as (frames along T, ``windows``)."""
    calls: list[tuple[int, tuple[int, ...] | None]] = []
    hook = dit.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append((args[0].shape[2], kwargs.get("windows"))), with_kwargs=True)
    results: dict[str, R] = {}
    per_run: dict[str, list[tuple[int, tuple[int, ...] | None]]] = {}
    try:
        for name, batch in (("batched", True), ("sequential", False)):
            calls.clear()
            runtime.batch_steps = batch
            try:
                results[name] = render_once()
            finally:
                runtime.batch_steps = True
            per_run[name] = list(calls)
    finally:
        hook.remove()
    return results, per_run


def test_batched_steps_equal_the_sequential_loop(speech) -> None:  # type: ignore[no-untyped-def]
    # 2.6 s: N0 N1 I0 N2 I1 N3 I2 N4 -> groups N0 | N1 | I0+N2 | I1+N3 | I2+N4 (N4: the one-frame last chunk)
    family = _warm_tiny()
    assert family.batch_steps and family.pipeline.batched_stage is not None
    request = RenderRequest(image=DEMO_IMAGE, audio=speech(2.6), seed=11)
    results, per_run = render_batched_and_sequential(family, family.modules["a2v"].get(), lambda: _frames(request))
    (batched, b_sink), (sequential, s_sink) = results["batched"], results["sequential"]
    steps = 5  # the tiny preset's sampler steps: one DiT forward each per window (or packed windows)
    assert len(per_run["sequential"]) == 8 * steps and all(w is None for _, w in per_run["sequential"])
    packed = [(t, w) for t, w in per_run["batched"] if w is not None]
    assert len(per_run["batched"]) == 5 * steps and len(packed) == 3 * steps
    # I_{k-1} (two anchors + e = 4 frames) packed with N_{k+1} (reference slot + C = 4 + L = 16)
    # the last pair: I2 with N4 (1 + 4 + 1 frames), which has an emission of its own (no I3 follows)
    assert {w for _, w in packed} == {(6, 21), (6, 6)}
    assert np.array_equal(batched, sequential)
    assert [f.data for f in b_sink.fragments] == [f.data for f in s_sink.fragments]
    # a batched render's snapshot resumes at the next group (the N step of the pair is in the state)
    state = b_sink.fragments[1].resume_state  # made by I0 + N2
    assert state is not None
    rest, resumed = _frames(request, resume_state=state)
    assert np.array_equal(rest, batched[b_sink.fragments[2].first_frame:])
    assert [f.data for f in resumed.fragments] == [f.data for f in b_sink.fragments[2:]]


def test_a_decoder_that_reads_the_reference_gets_it_once_per_job(speech) -> None:  # type: ignore[no-untyped-def]
    """The shipped decoder reads the reference (``VAEConfig.ref_window_radius``, ``ref_warp``): the context
    stage computes what it reads once per job (the window's keys, gathered once) and the decode stage
    passes it every emission. Streaming equals batch with it and a resumed render equals the
    uninterrupted one; its frames are not those of its own plain path (``plain_decoder``: the window and
    the warp's gate are trained open)."""
    from models.layers import WindowKeys
    from models.training.train_vae import plain_decoder
    from models.vae import CausalVAE

    warm = _warm_tiny()
    vae = warm.modules["vae"].get()
    assert isinstance(vae, CausalVAE) and vae.decoder.ref_window is not None and vae.decoder.ref_gate is not None
    calls: list[object] = []
    original = CausalVAE.reference_features

    def counted(self: CausalVAE, *args: object) -> object:
        calls.append(original(self, *args))  # type: ignore[arg-type]
        return calls[-1]

    request = RenderRequest(image=DEMO_IMAGE, audio=speech(1.4), seed=5)
    try:
        CausalVAE.reference_features = counted  # type: ignore[method-assign]
        streamed, sink = _frames(request, family=warm)
        assert len(calls) == 1  # once per job, not per emission
        assert isinstance(calls[0].source, WindowKeys)  # type: ignore[attr-defined]  # gathered once, no gradients
        batched, _ = _frames(request, mode="batch", family=warm)
    finally:
        CausalVAE.reference_features = original  # type: ignore[method-assign]
    assert np.array_equal(streamed, batched)
    state = sink.fragments[0].resume_state
    assert state is not None
    rest, _ = _frames(request, resume_state=state, family=warm)
    assert np.array_equal(rest, streamed[sink.fragments[1].first_frame:])
    loaded = {n: (plain_decoder(vae) if n == "vae" else m.get()) for n, m in warm.modules.items()}
    plain, _ = _frames(request, family=FamilyRuntime(warm.family, warm.preset, warm.checkpoint, loaded=loaded))
    assert plain.shape == streamed.shape and np.abs(plain.astype(int) - streamed.astype(int)).mean() > 1.0
