"""Input loading: every supported image mode and audio format loads correctly, every bad input gives an
InvalidInputError naming the field, the file and the fix."""

from __future__ import annotations

import resource
import struct
import subprocess
import tempfile
import wave
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.errors import InvalidInputError
from pipeline.inputs import (
    MAX_IMAGE_SIDE,
    MIN_IMAGE_SIDE,
    AudioSource,
    load_reference_image,
    validate_hls_directory,
    validate_output_path,
)
from pipeline.probe import AudioProbe, probe_audio

# ------------------------------------------------------------------------------------------- image


def gradient(w: int = 120, h: int = 80) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w]
    return np.stack([xx * 255 // (w - 1), yy * 255 // (h - 1), np.full_like(xx, 90)], axis=-1).astype(
        np.uint8
    )


def image_error(path: Path, *fragments: str) -> InvalidInputError:
    with pytest.raises(InvalidInputError) as e:
        load_reference_image(path, 64, 64)
    assert e.value.field == "image"
    assert str(path) in e.value.message
    for fragment in fragments:
        assert fragment in e.value.message, e.value.message
    return e.value


def test_rgb_image_is_center_cropped_and_resized(tmp_path: Path) -> None:
    rgb = gradient(120, 80)
    rgb[:, :20] = (255, 0, 0)  # a red band on the left: cropped away by the 1:1 centre crop
    Image.fromarray(rgb).save(tmp_path / "a.png")
    out = load_reference_image(tmp_path / "a.png", 64, 64)
    assert out.shape == (64, 64, 3) and out.dtype == np.uint8
    assert out[:, :3, 0].max() < 100  # no red at the left edge: columns 20..100 kept
    # The crop keeps columns 20..100 of the gradient: left edge red ~ 20*255/119.
    assert abs(int(out[32, 0, 0]) - 20 * 255 // 119) < 12 and abs(int(out[32, 63, 0]) - 99 * 255 // 119) < 12

    tall = load_reference_image(tmp_path / "a.png", 80, 40)  # portrait target from a landscape image
    assert tall.shape == (80, 40, 3)


@pytest.mark.parametrize(
    ("mode", "suffix"),
    [("L", ".png"), ("P", ".gif"), ("RGB", ".webp"), ("RGB", ".bmp"), ("RGB", ".jpg"), ("1", ".png")],
)  # fmt: skip
def test_image_modes_convert_to_rgb(tmp_path: Path, mode: str, suffix: str) -> None:
    rgb = Image.fromarray(gradient())
    im = rgb.convert(mode) if mode != "P" else rgb.quantize(64)
    path = tmp_path / f"img{suffix}"
    im.save(path)
    out = load_reference_image(path, 64, 64)
    assert out.shape == (64, 64, 3) and out.dtype == np.uint8
    expected = load_reference_image_from(im.convert("RGB"), tmp_path)
    tolerance = 60 if mode == "1" else 20  # 1-bit dithering vs. resampling; JPEG is lossy
    assert np.abs(out.astype(int) - expected.astype(int)).mean() < tolerance


def load_reference_image_from(im: Image.Image, tmp_path: Path) -> np.ndarray:
    im.save(tmp_path / "expected.png")
    return load_reference_image(tmp_path / "expected.png", 64, 64)


def test_sixteen_bit_images_are_rejected_with_the_fix(tmp_path: Path) -> None:
    values = np.tile(np.linspace(0, 65535, 100).astype(np.uint16), (100, 1))
    Image.fromarray(values).save(tmp_path / "g16.png")  # a real 16-bit PNG
    image_error(tmp_path / "g16.png", "16 bits per channel", "-depth 8")


def test_alpha_and_cmyk_are_rejected_with_the_fix(tmp_path: Path) -> None:
    rgba = np.zeros((80, 80, 4), dtype=np.uint8)
    rgba[..., 0] = 255
    rgba[20:60, 20:60, 3] = 255  # opaque red square, transparent elsewhere
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    image_error(tmp_path / "a.png", "alpha channel", "-alpha remove")
    Image.fromarray(rgba[..., :2].copy(), "LA").save(tmp_path / "la.png")
    image_error(tmp_path / "la.png", "alpha channel")
    pal = Image.fromarray(rgba, "RGBA").convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
    pal.save(tmp_path / "p.png", transparency=pal.getpixel((0, 0)))
    image_error(tmp_path / "p.png", "alpha channel")
    for suffix in (".jpg", ".tif"):
        Image.fromarray(gradient()).convert("CMYK").save(tmp_path / f"c{suffix}")
        image_error(tmp_path / f"c{suffix}", "CMYK", "-colorspace sRGB")


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    im = Image.fromarray(gradient(120, 80))
    exif = im.getexif()
    exif[0x0112] = 6  # rotate 90 CW to display
    im.save(tmp_path / "r.jpg", exif=exif)
    out = load_reference_image(tmp_path / "r.jpg", 120, 80)  # displayed as 80 wide, 120 tall
    assert out.shape == (120, 80, 3)
    # After the rotation, green (from rows) varies along width and red (from columns) along height.
    assert abs(int(out[60, 0, 1]) - int(out[60, 79, 1])) > 150
    assert abs(int(out[0, 40, 0]) - int(out[119, 40, 0])) > 150


def test_bad_images_are_rejected_with_clear_errors(tmp_path: Path) -> None:
    image_error(tmp_path / "missing.png", "does not exist")
    image_error(tmp_path, "is a directory")
    text = tmp_path / "notes.png"
    text.write_text("this is not an image\n")
    image_error(text, "not an image")
    good = tmp_path / "good.png"
    Image.fromarray(gradient()).save(good)
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(good.read_bytes()[:200])
    image_error(corrupt, "corrupt")
    jpeg = tmp_path / "trunc.jpg"
    Image.fromarray(gradient(400, 400)).save(jpeg, quality=95)
    jpeg.write_bytes(jpeg.read_bytes()[:800])
    image_error(jpeg, "corrupt")
    for w, h in [(1, 1), (63, 200)]:
        Image.new("RGB", (w, h)).save(tmp_path / f"small{w}.png")
        image_error(tmp_path / f"small{w}.png", f"{w}x{h}", f"minimum of {MIN_IMAGE_SIDE}")
    floats = tmp_path / "f.tif"
    Image.fromarray(np.ones((80, 80), dtype=np.float32)).save(floats)
    image_error(floats, "mode F")


def png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims ``width`` x ``height`` RGB, with one tiny IDAT: enough for Pillow to
    open it, and it would allocate width*height*3 bytes if anything tried to decode it."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(bytes(1000)))
        + chunk(b"IEND", b"")
    )
    return path


def test_huge_images_are_rejected_before_decoding(tmp_path: Path) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Beyond Pillow's own decompression-bomb limit: Pillow refuses at open; we still name our maximum.
    image_error(png_header_only(tmp_path / "huge.png", 20000, 20000), f"maximum of {MAX_IMAGE_SIDE}")
    # Within Pillow's limit but beyond ours: rejected from the header, before any pixel is decoded.
    image_error(
        png_header_only(tmp_path / "wide.png", 9000, 3000), "9000x3000", f"maximum of {MAX_IMAGE_SIDE}"
    )
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 50, f"peak RSS grew by {grown_mib:.0f} MiB: the pixels were decoded"


# ------------------------------------------------------------------------------------------- audio


def tone(path: Path, seconds: float, rate: int, channels: int, *codec: str) -> Path:
    subprocess.run(
        ["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", f"sine=frequency=300:sample_rate={rate}:duration={seconds}",
         "-ac", str(channels), *codec, str(path)],
        check=True,
    )  # fmt: skip
    return path


@pytest.mark.parametrize(
    ("suffix", "rate", "channels", "tolerance_s"),
    [(".wav", 8000, 1, 0.001), (".mp3", 22050, 2, 0.03), (".m4a", 44100, 2, 0.03), (".flac", 48000, 1, 0.001),
     (".ogg", 44100, 1, 0.03), (".wav", 48000, 2, 0.001)],
)  # fmt: skip
def test_audio_formats_load_with_the_right_duration(
    tmp_path: Path, suffix: str, rate: int, channels: int, tolerance_s: float
) -> None:
    path = tone(tmp_path / f"t{suffix}", 1.5, rate, channels)
    with AudioSource.open(path) as src:
        assert src.duration_s == pytest.approx(1.5, abs=tolerance_s)
        assert src.num_samples(16000) == pytest.approx(24000, abs=16000 * tolerance_s + 2)
        assert src.num_samples(48000) == pytest.approx(72000, abs=48000 * tolerance_s + 2)
        mid = src.read(20000, 21600, 16000)  # 0.1 s of a 300 Hz tone, after any codec ramp-in
        assert mid.dtype == np.float32
        assert 0.8 < float(np.sqrt(np.mean(mid**2))) / (0.125 / 2**0.5) < 1.2  # ffmpeg's sine: amplitude 1/8
        spectrum = np.abs(np.fft.rfft(mid))
        assert abs(int(np.argmax(spectrum)) * 16000 / len(mid) - 300) < 15


def test_read_pads_with_zeros_and_temp_files_do_not_outlive_the_source(tmp_path: Path) -> None:
    leftover_before = set(Path(tempfile.gettempdir()).glob("longtake-audio-*"))
    src = AudioSource.open(tone(tmp_path / "t.wav", 0.5, 16000, 1), model_rate=16000, output_rate=48000)
    assert len(src._tracks) == 2
    # POSIX: unlinked as soon as opened, so even a killed process leaves nothing in $TMPDIR.
    assert set(Path(tempfile.gettempdir()).glob("longtake-audio-*")) <= leftover_before
    n = src.num_samples(16000)
    assert n == 8000
    window = src.read(-100, 200, 16000)
    assert window.shape == (300,) and not window[:100].any() and window[100:].any()
    tail = src.read(n - 50, n + 50, 16000)
    assert tail[:50].any() and not tail[50:].any()
    assert src.read(n + 10, n + 20, 16000).tolist() == [0.0] * 10
    assert np.array_equal(src.read(0, n, 16000), src.read(0, n, 16000))
    with pytest.raises(ValueError, match="not 22050 Hz"):
        src.read(0, 10, 22050)
    src.close()
    with pytest.raises(ValueError, match="closed"):
        src.read(0, 10, 16000)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_reading_the_audio_maps_none_of_it(tmp_path: Path) -> None:
    """File pages a process touches stay in its RSS: a mapped track grew it ~48 MB per 10 minutes of
    video. The tracks are read with positioned reads, so no mapping of them ever appears."""
    with AudioSource.open(tone(tmp_path / "t.wav", 3.0, 16000, 1)) as src:
        for start in range(0, src.num_samples(48000), 7000):
            src.read(start - 500, start + 9000, 48000)
            src.read(start // 3 - 500, start // 3 + 3000, 16000)
        maps = Path("/proc/self/maps").read_text()
        assert "longtake-audio-" not in maps


def audio_error(path: Path, *fragments: str) -> None:
    with pytest.raises(InvalidInputError) as e:
        AudioSource.open(path)
    assert e.value.field == "audio" and str(path) in e.value.message
    for fragment in fragments:
        assert fragment in e.value.message, e.value.message


def test_bad_audio_is_rejected_with_clear_errors(tmp_path: Path) -> None:
    leftover_before = set(Path(tempfile.gettempdir()).glob("longtake-audio-*"))
    audio_error(tmp_path / "missing.wav", "does not exist")
    audio_error(tmp_path, "is a directory")
    garbage = tmp_path / "garbage.wav"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    audio_error(garbage, "WAV, MP3")
    text = tmp_path / "speech.mp3"
    text.write_text("hello\n" * 100)
    audio_error(text, "WAV, MP3")
    good = tone(tmp_path / "good.wav", 0.5, 16000, 1)
    truncated = tmp_path / "truncated.wav"
    truncated.write_bytes(good.read_bytes()[:30])  # cut inside the header
    audio_error(truncated)
    empty = tmp_path / "empty.wav"
    with wave.open(str(empty), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000), w.writeframes(b"")
    audio_error(empty, "no audio samples")
    zero_bytes = tmp_path / "zero.wav"
    zero_bytes.write_bytes(b"")
    audio_error(zero_bytes)
    video = tmp_path / "silent_video.mp4"
    subprocess.run(
        [
            "ffmpeg",
            "-v",
            "error",
            "-y",
            "-f",
            "lavfi",
            "-i",
            "testsrc=size=64x64:rate=5:duration=1",
            str(video),
        ],
        check=True,
    )
    audio_error(video, "video without an audio track")
    assert (
        set(Path(tempfile.gettempdir()).glob("longtake-audio-*")) <= leftover_before
    )  # failed opens leave no temp files


def test_silence_is_fine(tmp_path: Path) -> None:
    path = tmp_path / "silence.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000), w.writeframes(bytes(2 * 8000))
    with AudioSource.open(path) as src:
        assert src.duration_s == pytest.approx(0.5) and not src.read(0, 8000, 16000).any()


# ------------------------------------------------------------------------------------------ output


def test_validate_output_path(tmp_path: Path) -> None:
    assert (
        validate_output_path(tmp_path / "new" / "dir" / "out.mp4") == (tmp_path / "new/dir/out.mp4").resolve()
    )
    assert (tmp_path / "new" / "dir").is_dir()
    with pytest.raises(InvalidInputError) as e:
        validate_output_path(tmp_path)
    assert e.value.field == "out" and "is a directory" in e.value.message and str(tmp_path) in e.value.message
    with pytest.raises(InvalidInputError, match=r"must end in \.mp4"):
        validate_output_path(tmp_path / "out.mov")
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidInputError, match="cannot create directory"):
        validate_output_path(tmp_path / "file" / "out.mp4")


def test_validate_hls_directory(tmp_path: Path) -> None:
    assert validate_hls_directory(tmp_path / "hls") == (tmp_path / "hls").resolve()
    (tmp_path / "hls" / "index.m3u8").write_text("#EXTM3U\n")
    with pytest.raises(InvalidInputError, match="already holds a render.*--force"):
        validate_hls_directory(tmp_path / "hls")
    with pytest.raises(InvalidInputError, match="is a file"):
        validate_hls_directory(tmp_path / "hls" / "index.m3u8")


# ------------------------------------------------------------------------------ issue 18: one output rule, RGBA


def test_existing_outputs_follow_one_rule_refused_unless_overwrite(tmp_path: Path) -> None:
    """Item 3: an existing out.mp4 is refused like a non-empty --hls directory; ``overwrite``
    (--force) allows both: the MP4 is replaced at success, the earlier HLS render's files removed."""
    out = tmp_path / "out.mp4"
    out.write_bytes(b"an earlier video")
    with pytest.raises(InvalidInputError) as e:
        validate_output_path(out)
    assert e.value.field == "out" and "already exists" in e.value.message and "--force" in e.value.message
    assert validate_output_path(out, overwrite=True) == out.resolve() and out.read_bytes() == b"an earlier video"

    hls = tmp_path / "hls"
    hls.mkdir()
    for name in ("index.m3u8", "init.mp4", "seg_00000.m4s", "seg_00001.m4s", "FAILED"):
        (hls / name).write_bytes(b"x")
    with pytest.raises(InvalidInputError, match="--force"):
        validate_hls_directory(hls)
    assert validate_hls_directory(hls, overwrite=True) == hls.resolve() and list(hls.iterdir()) == []
    (hls / "notes.txt").write_text("mine")  # never removed, even with --force
    with pytest.raises(InvalidInputError) as e:
        validate_hls_directory(hls, overwrite=True)
    assert e.value.field == "hls" and "notes.txt" in e.value.message
    assert (hls / "notes.txt").exists()


@pytest.mark.parametrize("mode", ["RGBA", "LA"])
def test_fully_opaque_alpha_is_accepted(tmp_path: Path, mode: str) -> None:
    """Item 5: screenshots and exports carry an alpha channel that is 255 everywhere: no guess is
    needed, so they load exactly like the same image without alpha."""
    rgb = Image.fromarray(gradient())
    rgb.convert(mode).save(tmp_path / "opaque.png")
    assert Image.open(tmp_path / "opaque.png").mode == mode
    rgb.convert(mode[0] if mode == "LA" else "RGB").save(tmp_path / "plain.png")
    out = load_reference_image(tmp_path / "opaque.png", 64, 64)
    assert np.array_equal(out, load_reference_image(tmp_path / "plain.png", 64, 64))


def test_palette_image_with_unused_transparent_index_is_accepted(tmp_path: Path) -> None:
    pal = Image.fromarray(gradient()).quantize(16)
    unused = next(i for i in range(256) if i not in set(np.asarray(pal).ravel().tolist()))
    pal.save(tmp_path / "p.png", transparency=unused)
    assert load_reference_image(tmp_path / "p.png", 64, 64).shape == (64, 64, 3)


def test_probe_audio_is_fast_and_its_errors_read_well(tmp_path: Path) -> None:
    """Item 4/7: the torch-free audio check the CLI runs first; no "[Errno 1094995529]" in its words."""
    wav = tmp_path / "tone.wav"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\x01\x00" * 2 * 1600)
    assert probe_audio(wav) == AudioProbe(duration_s=0.1, channels=2)
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\xff" * 40)
    with pytest.raises(InvalidInputError) as e:
        probe_audio(bad)
    assert e.value.field == "audio" and str(bad) in e.value.message and "Errno" not in e.value.message
    with pytest.raises(InvalidInputError, match="zero length"):
        empty = tmp_path / "empty.wav"
        with wave.open(str(empty), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(16000)
        probe_audio(empty)
