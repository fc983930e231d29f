"""``longtake live``: stream a file (or stdin) into a live session at real-time pace (docs/sessions.md).

Who calls: :func:`worker.cli.main` dispatches ``live`` to :func:`cmd_live`. Steps: create the session
job (the image uploaded as ``submit`` does), print the job id and the preview page URL, connect the
audio WebSocket, stream 100 ms messages on the wall clock, send ``end`` at the end of the input,
then wait for the job and print its end reason, inserted silence and outputs.

Input: ``--audio-from FILE`` is decoded with PyAV to s16le at the file's own rate (resampled to 16 kHz
when the service does not take that rate; more than two channels are mixed to mono); ``-`` reads a
WAV stream from stdin, or raw s16le PCM when ``--rate`` (and ``--channels``) are given.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from worker.cli.options import add_option_argument, options_of
from worker.spec import SESSION_IDLE_DEFAULT_S, SESSION_SAMPLE_RATES

STEP_S = 0.1


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "live",
        help="stream audio into a live session at real-time pace",
        description="Create a live session, print its preview URL, stream the audio of FILE (or stdin: a "
        "WAV stream, or raw s16le PCM with --rate) at real-time pace, end the session at the end of the "
        "input and print its outputs (docs/sessions.md).",
    )
    p.add_argument("--image", required=True, help="reference image: a local file to upload, or a URI")
    p.add_argument("--audio-from", required=True, metavar="FILE|-", help="audio file to stream, or - for stdin")
    p.add_argument("--rate", type=int, help="stdin is raw s16le PCM at this sample rate (Hz)")
    p.add_argument("--channels", type=int, default=1, help="channels of raw stdin PCM (1 or 2)")
    p.add_argument("--latency", choices=["default", "low"], default="default",
                   help="default: N+I chunks (smoother); low: N chunks only (less compute per chunk; "
                   "the same audio look-ahead, docs/live.md) (default: default)")
    p.add_argument("--idle-timeout", type=float, metavar="SECONDS",
                   help="end the session after this long without audio "
                   f"(default: {SESSION_IDLE_DEFAULT_S:g} s, capped by the server)")
    p.add_argument("--seed", type=int, help="seed (>= 0)")
    p.add_argument("--preset", help="model preset (default: the server's)")
    p.add_argument("--text", help="text/scene prompt")
    add_option_argument(p)
    return p


# ---------------------------------------------------------------------------------------------- input


def decode_file(path: Path) -> tuple[int, int, Iterator[bytes]]:
    """(rate, channels, s16le blocks) of an audio file, decoded with PyAV."""
    import av

    if not path.is_file():
        raise FileNotFoundError(f"--audio-from {path}: no such file; give an audio file or - for stdin")
    container = av.open(str(path))
    if not container.streams.audio:
        container.close()
        raise ValueError(f"--audio-from {path}: has no audio stream; give an audio file (wav, mp3, flac, ...)")
    stream = container.streams.audio[0]
    rate = stream.rate if stream.rate in SESSION_SAMPLE_RATES else 16000
    channels = stream.channels if stream.channels in (1, 2) else 1
    resampler = av.AudioResampler(format="s16", layout="mono" if channels == 1 else "stereo", rate=rate)

    def blocks() -> Iterator[bytes]:
        try:
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    yield bytes(out.planes[0])[: out.samples * 2 * channels]
            for out in resampler.resample(None):
                yield bytes(out.planes[0])[: out.samples * 2 * channels]
        finally:
            container.close()

    return rate, channels, blocks()


def read_stdin(stream: BinaryIO, rate: int | None, channels: int) -> tuple[int, int, Iterator[bytes]]:
    """(rate, channels, s16le blocks) of stdin: raw PCM when ``rate`` is given, else a WAV stream."""
    if rate is not None:
        return rate, channels, iter(lambda: stream.read(4096), b"")
    head = stream.read(12)
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        raise ValueError("--audio-from -: stdin is not a WAV stream; pipe a WAV, or give --rate (and --channels) "
                         "for raw s16le PCM")
    wav_rate: int | None = None
    while True:
        chunk = stream.read(8)
        if len(chunk) < 8:
            raise ValueError("--audio-from -: the WAV stream ended before its data chunk")
        kind, size = chunk[:4], struct.unpack("<I", chunk[4:])[0]
        if kind == b"fmt ":
            fmt = stream.read(size + size % 2)
            tag, channels, wav_rate, _, _, bits = struct.unpack("<HHIIHH", fmt[:16])
            if tag not in (1, 0xFFFE) or bits != 16:
                raise ValueError(f"--audio-from -: WAV of format {tag} with {bits}-bit samples; pipe 16-bit PCM "
                                 "(e.g. `ffmpeg -i IN -f wav -acodec pcm_s16le -`)")
        elif kind == b"data":
            if wav_rate is None:
                raise ValueError("--audio-from -: the WAV stream has no fmt chunk before its data")
            return wav_rate, channels, iter(lambda: stream.read(4096), b"")
        else:
            stream.read(size + size % 2)


def paced(blocks: Iterator[bytes], rate: int, channels: int) -> Iterator[bytes]:
    """Messages of ``STEP_S`` of audio (whole frames), each yielded when the wall clock reaches it."""
    size = int(rate * STEP_S) * 2 * channels
    buf = b""
    sent_s = 0.0
    start = time.monotonic()
    for block in blocks:
        buf += block
        while len(buf) >= size:
            message, buf = buf[:size], buf[size:]
            time.sleep(max(0.0, start + sent_s - time.monotonic()))
            yield message
            sent_s += STEP_S
    tail = buf[: len(buf) - len(buf) % (2 * channels)]
    if tail:
        time.sleep(max(0.0, start + sent_s - time.monotonic()))
        yield tail


# ---------------------------------------------------------------------------------------------- command


def cmd_live(args: argparse.Namespace, *, api: str, token: str) -> int:
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    from worker.client import LongtakeClient

    options = options_of(args.options)  # a repeated key is a usage error before any audio is read
    if args.audio_from == "-":
        rate, channels, blocks = read_stdin(sys.stdin.buffer, args.rate, args.channels)
    else:
        rate, channels, blocks = decode_file(Path(args.audio_from))
    session: dict[str, object] = {"sample_rate": rate, "channels": channels, "latency": args.latency}
    if args.idle_timeout is not None:
        session["idle_timeout_s"] = args.idle_timeout
    spec: dict[str, object] = {"session": session}
    for field in ("seed", "preset", "text"):
        if getattr(args, field) is not None:
            spec[field] = getattr(args, field)
    image: Path | None = None
    if args.image.startswith(("s3://", "file://", "upload://")):
        spec["image"] = args.image
    else:
        image = Path(args.image)
        if not image.is_file():
            raise FileNotFoundError(f"--image {args.image}: no such file; give a local file or a URI")
    with LongtakeClient(api, token) as client:
        job = client.submit(spec, image=image, options=options)
        print(f"{job.id}  session at {rate} Hz, {channels} channel(s)", flush=True)
        url = client.preview_url(job.id)
        if url:
            print(f"preview: {url}", flush=True)
        ws_url = api.rstrip("/").replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        problems: list[str] = []
        with connect(f"{ws_url}/v1/jobs/{job.id}/audio", additional_headers={"Authorization": f"Bearer {token}"},
                     open_timeout=30, max_size=1 << 20) as ws:
            ready = threading.Event()
            ended = threading.Event()

            def listen() -> None:
                try:
                    for raw in ws:
                        msg = json.loads(raw)
                        if msg["type"] == "ready":
                            ready.set()
                        elif msg["type"] == "error":
                            problems.append(f"{msg['error']}: {msg['message']}")
                        elif msg["type"] == "ended" or msg.get("final"):
                            ended.set()
                except ConnectionClosed:
                    pass
                finally:
                    ready.set()
                    ended.set()

            listener = threading.Thread(target=listen, daemon=True)
            listener.start()
            print("waiting for a worker to start the session…", file=sys.stderr, flush=True)
            ready.wait()
            try:
                for message in paced(blocks, rate, channels):
                    if problems:
                        break
                    ws.send(message)
                if not problems:
                    ws.send(json.dumps({"type": "end"}))
                    ended.wait(60)
            except ConnectionClosed:
                pass
        listener.join(10)
        for problem in problems:
            print(f"longtake live: {problem}", file=sys.stderr)
        final = client.wait(job.id, poll_s=0.5)
    state = final.session or {}
    print(f"{final.id}  {final.status}  ended: {state.get('end_reason')}  audio {state.get('audio_s')} s, "
          f"silence inserted {state.get('silence_s')} s, chunk delay max {state.get('chunk_delay_max_s')} s")
    if final.error_code:
        print(f"  error {final.error_code}: {final.error_message}")
    for name, uri in final.outputs.items():
        print(f"  {name}: {uri}")
    return 0 if final.status == "succeeded" and not problems else 1
