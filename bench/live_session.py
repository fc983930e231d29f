"""A live session as a user runs one: ``longtake up`` on the embedded defaults, ``longtake live``.

    python -m bench.live_session --seconds 300 --json

Issue 13's acceptance run. Starts ``longtake up`` (SQLite job store and broker, local object store,
the API and one worker running the real pipeline: tiny family, embedded checkpoint) in a fresh home,
writes ``--seconds`` of synthetic speech, and runs ``longtake live --image <demo reference>
--audio-from <that file>`` — which streams it at real-time pace over the audio WebSocket, ends the
session at the end of the file and waits for the job. Meanwhile, every 5 s, it records the HLS
playlist's segment count (the playlist must grow while the session runs) and the resident memory of
the worker's process tree (worker and its rank). At the end: the job's session report (end reason,
audio and inserted silence), the final MP4's duration by ffprobe against the fed timeline, the
segment timeline's continuity, and the worker's peak RSS per minute of the session (minute 5 against
minute 1). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.inputs import DEMO_IMAGE, speech_wav
from bench.service import _tree_rss

FPS = 25


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _worker_pid(up_pid: int) -> int | None:
    for pid in _children(up_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if argv[2:4] == [b"worker.cli", b"worker"] or b"celery" in argv:
                return pid
        except OSError:
            continue
    return None


def _ffprobe_duration(path: Path) -> float:
    out = subprocess.run(["ffprobe", "-v", "error", "-show_entries", "format=duration", "-of", "csv=p=0", str(path)],
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def run(seconds: float, latency: str) -> dict[str, Any]:
    import httpx

    tmp = Path(tempfile.mkdtemp(prefix="longtake-bench-live-session-"))
    home, port = tmp / "home", _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LONGTAKE_")}
    env.update({"LONGTAKE_LOG_LEVEL": "WARNING", "LONGTAKE_LOG_JSON": "false",
                "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])})
    audio = speech_wav(tmp / "speech.wav", seconds)
    up_log = (tmp / "up.log").open("wb")
    up = subprocess.Popen([sys.executable, "-m", "worker.cli", "up", "--home", str(home), "--port", str(port)],
                          env=env, stdout=up_log, stderr=subprocess.STDOUT, start_new_session=True)
    report: dict[str, Any] = {"seconds": seconds, "latency": latency}
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"longtake up did not start:\n{(tmp / 'up.log').read_text()[-3000:]}")
            time.sleep(0.5)
        token = (home / "token").read_text().strip()
        live_out = (tmp / "live.out").open("wb")
        t0 = time.monotonic()
        live = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "live", "--image", str(DEMO_IMAGE), "--audio-from", str(audio),
             "--latency", latency, "--api", url, "--token", token],
            env=env, stdout=live_out, stderr=subprocess.STDOUT)
        samples: list[dict[str, float]] = []
        while live.poll() is None:
            worker = _worker_pid(up.pid)
            playlists = list((home / "objects").rglob("index.m3u8")) if (home / "objects").exists() else []
            text = playlists[0].read_text() if playlists else ""
            samples.append({"t": round(time.monotonic() - t0, 1), "segments": text.count(".m4s"),
                            "endlist": float("#EXT-X-ENDLIST" in text),
                            "rss_mb": round(_tree_rss(worker) / 2**20, 1) if worker else 0.0})
            time.sleep(5)
        wall = time.monotonic() - t0
        out = (tmp / "live.out").read_text()
        job_id = out.split()[0]
        job = httpx.get(f"{url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"}).json()
        session = job.get("session") or {}
        final = Path(str(job["outputs"]["mp4"]).removeprefix("file://"))
        duration = _ffprobe_duration(final)
        growing = [s["segments"] for s in samples if not s["endlist"]]
        minutes: dict[int, float] = {}
        for s in samples:
            if s["rss_mb"] > 0:
                m = int(s["t"] // 60) + 1
                minutes[m] = max(minutes.get(m, 0.0), s["rss_mb"])
        last = max((m for m in minutes if m <= int(seconds // 60)), default=None)
        report.update({
            "cli_rc": live.returncode,
            "wall_s": round(wall, 1),
            "status": job["status"],
            "end_reason": session.get("end_reason"),
            "audio_s": session.get("audio_s"),
            "silence_s": session.get("silence_s"),
            "timeline_s": session.get("duration_s"),
            "final_mp4_s": round(duration, 3),
            "final_minus_timeline_frames": round((duration - float(session.get("duration_s") or 0)) * FPS, 2),
            "chunk_delay_mean_s": session.get("chunk_delay_mean_s"),
            "chunk_delay_max_s": session.get("chunk_delay_max_s"),
            "playlist_segments_while_live": growing[:: max(1, len(growing) // 12)],
            "playlist_grew": len(growing) >= 2 and growing[-1] > growing[0],
            "worker_peak_rss_mb_by_minute": minutes,
            "minute_last_over_minute_1": round(minutes[last] / minutes[1], 4) if last and minutes.get(1) else None,
            "cli_output": out.strip().splitlines()[-4:],
        })
        return report
    finally:
        try:
            os.killpg(up.pid, 15)
            up.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(up.pid, 9)
        up_log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=300.0, help="seconds of speech fed at real-time pace")
    p.add_argument("--latency", choices=["default", "low"], default="default")
    p.add_argument("--json", action="store_true", help="one JSON object (default: indented)")
    a = p.parse_args(argv)
    report = run(a.seconds, a.latency)
    print(json.dumps(report) if a.json else json.dumps(report, indent=2))
    ok = report["status"] == "succeeded" and report["playlist_grew"] and abs(report["final_minus_timeline_frames"]) <= 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
