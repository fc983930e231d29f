"""Live-session benchmark: audio fed while it renders, the delay from its arrival to publication.

    python -m bench.live --seconds 60 --json

A feeder thread sends ``assets/demo/speech.wav`` (looped to ``--seconds``) through ``LiveClock`` +
``LiveAudioWriter`` into a live directory in 0.1 s messages, either at exactly real-time pace
(``realtime``: message ``i`` at ``i × 0.1 s`` after the first) or in TTS-like bursts (``bursty``:
``--burst-s`` of audio at ``--burst-speed`` × real time, then a gap of ``--gap-s``, longer than a
chunk: the live clock fills what the burst's lead does not cover with silence). ``render(live=True)``
on the embedded tiny defaults renders it in the default mode (N + I chunks) and the low-latency mode
(N chunks only). Each (feed, mode) case runs in its own process (peak RSS is a process high-water
mark) and prints one JSON object:

* ``delay_p50_s``, ``delay_p95_s``, ``delay_max_s``: ``RenderProgress.audio_delay_s`` over the
  emissions (delivery of the fragment − arrival of the last audio it needed);
* ``delay_first_quarter_s`` / ``delay_last_quarter_s`` (medians) and ``keeps_up``: the last quarter's
  median is within one chunk of the first's (a render slower than the feed falls further behind);
* ``realtime_factor``: video seconds per second of render wall time; ``lag_at_end_s``: how long after
  the feed's end the last fragment was delivered;
* ``silence_s``: what the live clock inserted; ``continuous``: every fragment starts where the one
  before ended (frames and seconds) and the video is the fed timeline within one frame;
* ``rss_minute1_mb``, ``rss_last_minute_mb`` (runs of two minutes or more): the peak RSS of the
  first and of the last whole minute of video.

``--compare`` (default when neither ``--feed`` nor ``--mode`` is given) runs the four cases and
prints them with the low-latency / default ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import wave
from pathlib import Path

import torch

from bench.inputs import DEMO_AUDIO, DEMO_IMAGE
from bench.machine import machine
from pipeline.host import reset_peak_rss

MESSAGE_S = 0.1


def _looped_pcm(seconds: float) -> tuple[bytes, int, int]:
    with wave.open(str(DEMO_AUDIO)) as f:
        rate, channels, pcm = f.getframerate(), f.getnchannels(), f.readframes(f.getnframes())
    need = int(seconds * rate) * 2 * channels
    return (pcm * (need // len(pcm) + 1))[:need], rate, channels


def _feeder(directory: Path, seconds: float, feed: str, burst_s: float, burst_speed: float,
            gap_s: float) -> tuple[threading.Thread, dict[str, float]]:
    from pipeline.live import LiveAudioWriter, LiveClock, LiveMeta

    pcm, rate, channels = _looped_pcm(seconds)
    writer = LiveAudioWriter(directory, LiveMeta(rate, channels))
    clock = LiveClock(writer, max_lag_s=0.2, max_ahead_s=burst_s * 2 + 1)
    step = int(rate * MESSAGE_S) * 2 * channels
    info: dict[str, float] = {}

    def sleep_until(t: float) -> None:
        while (left := t - time.monotonic()) > 0:
            clock.tick()
            time.sleep(min(left, 0.02))

    def run() -> None:
        t0 = time.monotonic()
        due = t0
        sent_in_burst = 0.0
        for i in range(0, len(pcm), step):
            sleep_until(due)
            clock.feed(pcm[i : i + step])
            if feed == "realtime":
                due = t0 + (i // step + 1) * MESSAGE_S
            else:
                sent_in_burst += MESSAGE_S
                due = time.monotonic() + MESSAGE_S / burst_speed
                if sent_in_burst >= burst_s:
                    sent_in_burst = 0.0
                    due += gap_s
        sleep_until(due)
        writer.close("closed")
        info["end_t"] = time.time()

    return threading.Thread(target=run, daemon=True, name="live-feeder"), info


def run_case(seconds: float, feed: str, use_i: bool, *, burst_s: float, burst_speed: float, gap_s: float,
             threads: int | None) -> dict[str, object]:
    from pipeline.host import default_threads, peak_rss_bytes
    from pipeline.media_types import Fragment, InitSegment
    from pipeline.render import RenderProgress, RenderRequest, render

    torch.set_num_threads(threads or default_threads())
    fragments: list[tuple[int, int, float, float]] = []  # (first_frame, num_frames, start_s, duration_s)

    class TimelineSink:  # keeps the timestamps only, never the bytes
        def open(self, init: InitSegment) -> None: ...

        def write(self, fragment: Fragment) -> None:
            fragments.append((fragment.first_frame, fragment.num_frames, fragment.start_s, fragment.duration_s))

        def close(self, *, ok: bool) -> None: ...

    delays: list[float] = []
    per_minute: dict[int, int] = {}
    minute = 0
    reset_possible = reset_peak_rss()

    def on_progress(p: RenderProgress) -> None:
        nonlocal minute
        if p.audio_delay_s is not None:
            delays.append(p.audio_delay_s)
        now = int(p.frames_done / 25 // 60)
        if now != minute and reset_possible:
            per_minute[minute] = peak_rss_bytes()
            reset_peak_rss()
            minute = now

    with tempfile.TemporaryDirectory(prefix="longtake-bench-live-") as tmp:
        directory = Path(tmp) / "live"
        feeder, info = _feeder(directory, seconds, feed, burst_s, burst_speed, gap_s)
        # a warm worker: models loaded and kernels run once (a 1 s file render) before the session
        from bench.inputs import speech_wav

        render(RenderRequest(image=DEMO_IMAGE, audio=speech_wav(Path(tmp) / "warm.wav", 1.0)), [TimelineSink()])
        fragments.clear()
        reset_peak_rss()
        feeder.start()
        r = render(RenderRequest(image=DEMO_IMAGE, audio=directory, live=True, use_i_chunks=use_i),
                   [TimelineSink()], on_progress=on_progress)
        done = time.time()
        feeder.join()
    per_minute[minute] = r.peak_rss_bytes
    whole = [m for m in sorted(per_minute) if (m + 1) * 60 <= r.duration_s]
    continuous = all(b[0] == a[0] + a[1] and abs(b[2] - (a[2] + a[3])) < 1e-9
                     for a, b in zip(fragments, fragments[1:], strict=False))
    continuous = continuous and abs(r.num_frames - r.live_fed_s * 25) <= 1
    q = max(1, len(delays) // 4)
    first_q, last_q = statistics.median(delays[:q]), statistics.median(delays[-q:])
    return {
        "feed": feed,
        "mode": "default" if use_i else "low-latency",
        "threads": torch.get_num_threads(),
        "machine": machine(),
        "fed_s": r.live_fed_s,
        "silence_s": r.live_silence_s,
        "video_s": r.duration_s,
        "emissions": len(delays),
        "delay_p50_s": statistics.median(delays),
        "delay_p95_s": sorted(delays)[min(len(delays) - 1, int(0.95 * len(delays)))],
        "delay_max_s": max(delays),
        "delay_first_quarter_s": first_q,
        "delay_last_quarter_s": last_q,
        "keeps_up": last_q <= first_q + 16 / 25,
        "realtime_factor": r.duration_s / r.wall_s,
        "lag_at_end_s": done - info["end_t"],
        "continuous": continuous,
        "rss_minute1_mb": per_minute[whole[0]] / 2**20 if len(whole) >= 2 else None,
        "rss_last_minute_mb": per_minute[whole[-1]] / 2**20 if len(whole) >= 2 else None,
        "peak_rss_mb": r.peak_rss_bytes / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.live", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0, help="audio fed per case")
    p.add_argument("--feed", choices=["realtime", "bursty"], default=None)
    p.add_argument("--mode", choices=["default", "low-latency"], default=None)
    p.add_argument("--burst-s", type=float, default=2.0, help="bursty: seconds of audio per burst")
    p.add_argument("--burst-speed", type=float, default=5.0, help="bursty: x real time within a burst")
    p.add_argument("--gap-s", type=float, default=3.0, help="bursty: gap after each burst (> a chunk)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    opts = dict(burst_s=args.burst_s, burst_speed=args.burst_speed, gap_s=args.gap_s, threads=args.threads)
    if args.feed and args.mode:
        out = run_case(args.seconds, args.feed, args.mode == "default", **opts)  # type: ignore[arg-type]
        print(json.dumps(out) if args.json else json.dumps(out, indent=2))
        return 0
    results = []
    for feed in [args.feed] if args.feed else ["realtime", "bursty"]:
        for mode in [args.mode] if args.mode else ["default", "low-latency"]:
            cmd = [sys.executable, "-m", "bench.live", "--seconds", str(args.seconds), "--feed", feed, "--mode", mode,
                   "--burst-s", str(args.burst_s), "--burst-speed", str(args.burst_speed), "--gap-s", str(args.gap_s),
                   "--json"] + (["--threads", str(args.threads)] if args.threads else [])
            run = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results.append(json.loads(run.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), file=sys.stderr)
    ratios = {}
    for feed in {r["feed"] for r in results}:
        by = {r["mode"]: r for r in results if r["feed"] == feed}
        if len(by) == 2:
            ratios[feed] = {k: by["low-latency"][k] / by["default"][k]  # type: ignore[operator]
                            for k in ("delay_p50_s", "delay_p95_s", "delay_max_s", "realtime_factor")}
    print(json.dumps({"cases": results, "low_latency_over_default": ratios}, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
