"""LiveAudioSource (pipeline/live_source.py): the live feed read as it grows, equal to AudioSource."""

from __future__ import annotations

import threading
import time
import wave
from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import CancelledError, InvalidInputError, LiveFeedError
from pipeline.inputs import AudioReader, AudioSource
from pipeline.live import LiveAudioWriter, LiveEnd, LiveMeta
from pipeline.live_source import LiveAudioSource


def _pcm(rate: int, channels: int, seconds: float, seed: int = 0) -> np.ndarray:
    n = int(rate * seconds)
    t = np.arange(n) / rate
    rng = np.random.default_rng(seed)
    x = 8000 * np.sin(2 * np.pi * 220 * t)[:, None] + 2000 * rng.standard_normal((n, channels))
    return x.astype("<i2")


def _wav(path: Path, pcm: np.ndarray, rate: int) -> Path:
    with wave.open(str(path), "wb") as f:
        f.setnchannels(pcm.shape[1])
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm.tobytes())
    return path


@pytest.mark.parametrize(("rate", "channels"), [(16000, 1), (48000, 2), (22050, 2)])
def test_fed_in_random_pieces_equals_audio_source_on_the_same_wav(tmp_path: Path, rate: int, channels: int) -> None:
    pcm = _pcm(rate, channels, 1.3)
    writer = LiveAudioWriter(tmp_path / "live", LiveMeta(rate, channels))
    rng = np.random.default_rng(1)
    with LiveAudioSource(tmp_path / "live") as live:
        assert isinstance(live, AudioReader)
        pos = 0
        while pos < len(pcm):
            n = int(rng.integers(1, rate // 5))
            writer.write(pcm[pos : pos + n].tobytes())
            pos += n
            live.poll()  # convert while it grows, at polling moments unrelated to the blocks
        writer.close("closed")
        assert live.wait(None, 16000) and live.wait(None, 48000)
        with AudioSource.open(_wav(tmp_path / "a.wav", pcm, rate)) as file:
            for r in (16000, 48000):
                assert live.num_samples(r) == file.num_samples(r)
                # tolerance 0: the same resampler on the same samples, fed in fixed blocks
                np.testing.assert_array_equal(live.read(-5, live.num_samples(r) + 7, r),
                                              file.read(-5, file.num_samples(r) + 7, r))
        assert live.end == LiveEnd("closed", len(pcm), 0)


def test_view_grows_with_waits_only_and_reads_past_it_are_refused(tmp_path: Path) -> None:
    writer = LiveAudioWriter(tmp_path / "live", LiveMeta(16000, 1))
    writer.write(_pcm(16000, 1, 0.5).tobytes(), t=100.0)
    with LiveAudioSource(tmp_path / "live") as live:
        assert live.num_samples(16000) == 0
        assert live.wait(4000, 16000, timeout_s=1)
        assert live.num_samples(16000) == 4000 and live.available_frames() == 8000
        live.read(0, 4000, 16000)
        with pytest.raises(RuntimeError, match="audio_lookahead_frames"):
            live.read(0, 4001, 16000)
        assert not live.wait(9000, 16000, timeout_s=0.05)  # not there yet: times out
        writer.write(_pcm(16000, 1, 0.5).tobytes(), t=101.0)
        writer.close("closed")
        assert live.wait(100_000, 16000, timeout_s=1)  # ended before: the view is the whole feed
        assert live.num_samples(16000) == 16000 and live.ended
        assert not live.read(15990, 16010, 16000)[10:].any()  # zeros past the end, as for a file


def test_wait_blocks_until_a_writer_thread_covers_the_position(tmp_path: Path) -> None:
    writer = LiveAudioWriter(tmp_path / "live", LiveMeta(24000, 1))
    pcm = _pcm(24000, 1, 1.0)

    def feed() -> None:
        for i in range(0, len(pcm), 2400):
            time.sleep(0.01)
            writer.write(pcm[i : i + 2400].tobytes())
        writer.close("closed")

    with LiveAudioSource(tmp_path / "live") as live:
        thread = threading.Thread(target=feed)
        thread.start()
        assert live.wait(8000, 16000)
        assert live.available_frames() >= 12000
        assert live.wait(None, 48000)
        thread.join()
        assert live.num_samples(48000) == 48000 and live.end is not None


def test_arrival_time_is_the_first_index_line_covering_the_position(tmp_path: Path) -> None:
    writer = LiveAudioWriter(tmp_path / "live", LiveMeta(16000, 1))
    writer.write(b"\x00\x00" * 1600, t=10.0)
    writer.write_silence(1600, t=11.0)
    writer.write(b"\x00\x00" * 1600, t=12.0)
    with LiveAudioSource(tmp_path / "live") as live:
        live.poll()
        assert [live.arrival_time(f) for f in (0, 1600, 1601, 3200, 4800)] == [10.0, 10.0, 11.0, 11.0, 12.0]
        with pytest.raises(ValueError, match="in order"):
            live.arrival_time(100)
        with pytest.raises(ValueError, match="holds 4800 frames"):
            live.arrival_time(4801)
        writer.close("closed")
        live.poll()
        assert live.arrival_time(10_000) == 12.0  # past the end: the last line


def test_cancel_and_stall_end_a_wait(tmp_path: Path) -> None:
    LiveAudioWriter(tmp_path / "live", LiveMeta(16000, 1)).write(b"\x00\x00" * 160)
    cancel = threading.Event()
    threading.Timer(0.05, cancel.set).start()
    with LiveAudioSource(tmp_path / "live", should_cancel=cancel.is_set) as live, \
            pytest.raises(CancelledError, match="cancelled"):
        live.wait(16000, 16000)
    with LiveAudioSource(tmp_path / "live", stall_timeout_s=0.1) as live, \
            pytest.raises(LiveFeedError, match="has not grown"):
        live.wait(16000, 16000)


def test_a_directory_that_is_no_live_feed_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="not a live directory") as info:
        LiveAudioSource(tmp_path)
    assert info.value.field == "audio"
