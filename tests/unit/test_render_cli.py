"""`longtake render` end to end on bad inputs: a clear error naming the input and the fix, a
non-zero exit, and no file left that looks like a finished output. And one good render."""

from __future__ import annotations

import shutil
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from bench.inputs import DEMO_IMAGE
from worker.cli.render import main


def png_header_only(path: Path, w: int, h: int) -> Path:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16))
                     + chunk(b"IEND", b""))
    return path


def _image(tmp: Path, name: str, mode: str, size: tuple[int, int] = (128, 128)) -> Path:
    rgb = np.random.default_rng(0).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    im = Image.fromarray(rgb)
    if mode == "I;16":
        im = Image.fromarray(np.full((size[1], size[0]), 30000, dtype=np.uint16))
    elif mode != "RGB":
        im = im.convert(mode)
    path = tmp / name
    im.save(path)
    return path


BadCase = Callable[[Path, Path], tuple[list[str], str, str]]  # -> argv extras, field, words in message


def case_missing_image(tmp: Path, audio: Path) -> tuple[list[str], str, str]:
    return ["--image", str(tmp / "nope.png"), "--audio", str(audio)], "image", "does not exist"


def case_text_named_png(tmp: Path, audio: Path) -> tuple[list[str], str, str]:
    (tmp / "notes.png").write_text("this is not an image\n")
    return ["--image", str(tmp / "notes.png"), "--audio", str(audio)], "image", "not a recognised image"


def case_one_pixel(tmp: Path, audio: Path) -> tuple[list[str], str, str]:
    return ["--image", str(_image(tmp, "dot.png", "RGB", (1, 1))), "--audio", str(audio)], "image", "minimum"


def case_alpha(tmp: Path, audio: Path) -> tuple[list[str], str, str]:
    return ["--image", str(_image(tmp, "a.png", "RGBA")), "--audio", str(audio)], "image", "alpha"


def case_cmyk(tmp: Path, audio: Path) -> tuple[list[str], str, str]:
    return ["--image", str(_image(tmp, "c.jpg", "CMYK")), "--audio", str(audio)], "image", "CMYK"


def case_sixteen_bit(tmp: Path, audio: Path) -> tuple[list[str], str, str]:
    return ["--image", str(_image(tmp, "g.png", "I;16")), "--audio", str(audio)], "image", "16 bits"


def case_huge(tmp: Path, audio: Path) -> tuple[list[str], str, str]:
    path = png_header_only(tmp / "huge.png", 20000, 20000)
    return ["--image", str(path), "--audio", str(audio)], "image", "maximum"


def case_corrupt_wav(tmp: Path, audio: Path) -> tuple[list[str], str, str]:
    (tmp / "bad.wav").write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\xff" * 40)
    return ["--image", str(DEMO_IMAGE), "--audio", str(tmp / "bad.wav")], "audio", "audio"


def case_zero_length_audio(tmp: Path, audio: Path) -> tuple[list[str], str, str]:
    import wave

    with wave.open(str(tmp / "empty.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
    return ["--image", str(DEMO_IMAGE), "--audio", str(tmp / "empty.wav")], "audio", "audio"


def case_missing_audio(tmp: Path, audio: Path) -> tuple[list[str], str, str]:
    return ["--image", str(DEMO_IMAGE), "--audio", str(tmp / "nope.wav")], "audio", "does not exist"


CASES = [case_missing_image, case_text_named_png, case_one_pixel, case_alpha, case_cmyk, case_sixteen_bit,
         case_huge, case_corrupt_wav, case_zero_length_audio, case_missing_audio]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__[5:] for c in CASES])
def test_bad_input_is_a_clear_error_and_leaves_no_output(case: BadCase, tmp_path: Path, speech, capsys) -> None:  # type: ignore[no-untyped-def]
    argv, field, words = case(tmp_path, speech(0.5))
    out = tmp_path / "out" / "video.mp4"
    code = main([*argv, "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code != 0
    assert f"[{field}]" in err and words in err, err
    bad_path = argv[argv.index(f"--{field}") + 1]
    assert bad_path in err, "the message names the input"
    assert ";" in err, "the message carries a fix after the problem"
    assert not out.exists() and not Path(str(out) + ".partial").exists()


def test_directory_as_out_is_rejected(tmp_path: Path, speech, capsys) -> None:  # type: ignore[no-untyped-def]
    out_dir = tmp_path / "videos"
    out_dir.mkdir()
    code = main(["--image", str(DEMO_IMAGE), "--audio", str(speech(0.5)), "--out", str(out_dir), "--quiet"])
    err = capsys.readouterr().err
    assert code != 0 and "[out]" in err and str(out_dir) in err
    assert list(out_dir.iterdir()) == []


def test_good_render_writes_mp4_and_summary(tmp_path: Path, speech, capsys) -> None:  # type: ignore[no-untyped-def]
    ref = tmp_path / "ref.jpg"
    shutil.copy(DEMO_IMAGE, tmp_path / "ref.png")
    Image.open(tmp_path / "ref.png").convert("RGB").save(ref)
    out = tmp_path / "v.mp4"
    hls = tmp_path / "live"
    code = main(["--image", str(ref), "--audio", str(speech(0.7)), "--text", "a studio", "--out", str(out),
                 "--hls", str(hls), "--quiet"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert out.is_file() and out.stat().st_size > 1000
    assert "time to first frame" in captured.out and "peak memory" in captured.out
    assert "#EXT-X-ENDLIST" in (hls / "index.m3u8").read_text()
