"""The wan family for users: ``longtake render --family wan --weights DIR`` writes an MP4 whose video
is as long as its audio (read back by ffprobe); absent weights fail with the download to run; a job
spec names weights only by a model name from the operator's allow-list."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from bench.inputs import DEMO_IMAGE, speech_wav
from models.wan.tiny_release import write_tiny_infinitetalk
from worker.cli.render import main as render_main
from worker.settings import Settings
from worker.spec import JobSpec, spec_context


def _ffprobe(path: Path) -> dict[str, float]:
    out = subprocess.run(["ffprobe", "-v", "error", "-show_entries", "stream=codec_type,duration,nb_frames",
                          "-of", "json", str(path)], check=True, capture_output=True, text=True).stdout
    return {s["codec_type"]: float(s["duration"]) for s in json.loads(out)["streams"]}


def test_cli_renders_the_tiny_release_to_an_mp4_as_long_as_its_audio(tmp_path: Path) -> None:
    weights = write_tiny_infinitetalk(tmp_path / "weights")
    audio = speech_wav(tmp_path / "speech.wav", 1.3)
    out = tmp_path / "out.mp4"
    rc = render_main(["--family", "wan", "--preset", "tiny", "--weights", str(weights), "--image", str(DEMO_IMAGE),
                      "--audio", str(audio), "--text", "w1 w2", "--out", str(out), "--quiet", "--threads", "1"])
    assert rc == 0 and out.is_file()
    durations = _ffprobe(out)
    assert abs(durations["video"] - durations["audio"]) <= 1 / 25 + 1e-6, durations
    assert abs(durations["video"] - 1.3) <= 1 / 25 + 1e-6, durations


def test_cli_names_the_missing_downloads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    audio = speech_wav(tmp_path / "speech.wav", 0.5)
    rc = render_main(["--family", "wan", "--weights", str(tmp_path / "empty"), "--image", str(DEMO_IMAGE),
                      "--audio", str(audio), "--out", str(tmp_path / "o.mp4"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "preset 'infinitetalk'" in err  # the family's default preset
    assert "huggingface-cli download Wan-AI/Wan2.1-I2V-14B-480P" in err and "chinese-wav2vec2-base" in err


def test_cli_model_name_from_the_operators_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LONGTAKE_MODELS", json.dumps({"wan-local": str(tmp_path / "w")}))
    args = ["--family", "wan", "--image", str(DEMO_IMAGE), "--audio", str(speech_wav(tmp_path / "a.wav", 0.5)),
            "--out", str(tmp_path / "o.mp4"), "--quiet"]
    assert render_main([*args, "--model", "nope"]) == 2
    assert "[model]" in capsys.readouterr().err
    assert render_main([*args, "--model", "wan-local"]) == 2  # resolved to its folder, which is empty
    assert f"the weights under {tmp_path / 'w'} are incomplete" in capsys.readouterr().err


def test_spec_takes_a_model_name_only_from_the_allow_list() -> None:
    base = {"image": "s3://media-bucket/face.png", "audio": "s3://media-bucket/a.wav", "family": "wan", "preset": "infinitetalk"}
    ctx = spec_context(None, models=["infinitetalk"])
    assert JobSpec.model_validate({**base, "model": "infinitetalk"}, context=ctx).model == "infinitetalk"
    for bad in ("flashtalk", "/weights/InfiniteTalk", "../x"):
        with pytest.raises(ValidationError) as err:
            JobSpec.model_validate({**base, "model": bad}, context=ctx)
        assert err.value.errors()[0]["loc"] == ("model",), err.value
    with pytest.raises(ValidationError):
        JobSpec.model_validate({**base, "checkpoint": "/weights"}, context=ctx)  # no path field at all
    s = Settings(models={"infinitetalk": Path("/w")})
    assert s.model_weights("infinitetalk") == Path("/w") and s.model_weights(None) is None
