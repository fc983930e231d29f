"""Just enough ISO-BMFF parsing to remux the encoder's fMP4 into MKV for KVS.

``parse_init`` reads the tracks (codec private data, timescale, edit list) from ``ftyp``+``moov``;
``parse_fragment`` turns one ``moof``+``mdat`` into samples with their decode/presentation times,
sizes and sync flags. The fragment bytes must start at the ``moof`` and use moof-relative data
offsets (``default-base-is-moof``, as CMAF and the project's encoder write them).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Track:
    track_id: int
    kind: str  # "video" | "audio"
    codec: str  # sample entry type: "avc1", "mp4a", ...
    timescale: int
    codec_private: bytes  # avcC payload (video) / AudioSpecificConfig (audio)
    width: int = 0
    height: int = 0
    sample_rate: int = 0
    channels: int = 0
    media_time: int = 0  # edit list start, in track timescale
    default_duration: int = 0
    default_size: int = 0
    default_flags: int = 0


@dataclass(frozen=True)
class Sample:
    track_id: int
    dts: int  # track timescale
    cto: int
    duration: int
    data: bytes
    is_sync: bool


def iter_boxes(data: bytes, start: int = 0, end: int | None = None) -> Iterator[tuple[str, int, int]]:
    """(type, payload start, box end) of the boxes in ``data[start:end]``."""
    end = len(data) if end is None else end
    pos = start
    while pos + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, pos)
        header = 8
        if size == 1:
            size = struct.unpack_from(">Q", data, pos + 8)[0]
            header = 16
        elif size == 0:
            size = end - pos
        if size < header or pos + size > end:
            raise ValueError(f"malformed MP4 box {kind!r} of size {size} at byte {pos}")
        yield kind.decode("latin-1"), pos + header, pos + size
        pos += size


def _child(data: bytes, start: int, end: int, kind: str) -> tuple[int, int] | None:
    for k, s, e in iter_boxes(data, start, end):
        if k == kind:
            return s, e
    return None


def _need(data: bytes, start: int, end: int, path: str) -> tuple[int, int]:
    cur = (start, end)
    for kind in path.split("/"):
        found = _child(data, cur[0], cur[1], kind)
        if found is None:
            raise ValueError(f"MP4 init segment has no {path} box (missing {kind})")
        cur = found
    return cur


def _descriptor(data: bytes, pos: int) -> tuple[int, int, int]:
    """(tag, payload start, payload end) of an MPEG-4 descriptor."""
    tag = data[pos]
    pos += 1
    size = 0
    for _ in range(4):
        b = data[pos]
        pos += 1
        size = (size << 7) | (b & 0x7F)
        if not b & 0x80:
            break
    return tag, pos, pos + size


def _audio_specific_config(data: bytes, s: int, e: int) -> bytes:
    tag, p, end = _descriptor(data, s + 4)  # esds is a full box
    if tag != 0x03:
        raise ValueError("esds without ES_Descriptor")
    flags = data[p + 2]
    p += 3
    if flags & 0x80:
        p += 2
    if flags & 0x40:
        p += 1 + data[p]
    if flags & 0x20:
        p += 2
    tag, p, end = _descriptor(data, p)
    if tag != 0x04:
        raise ValueError("esds without DecoderConfigDescriptor")
    tag, p, end = _descriptor(data, p + 13)
    if tag != 0x05:
        raise ValueError("esds without DecoderSpecificInfo (AudioSpecificConfig)")
    return data[p:end]


def parse_init(data: bytes) -> dict[int, Track]:
    """Tracks of an fMP4 init segment, by track id."""
    moov = _need(data, 0, len(data), "moov")
    trex: dict[int, tuple[int, int, int]] = {}
    mvex = _child(data, *moov, "mvex")
    if mvex:
        for k, s, _ in iter_boxes(data, *mvex):
            if k == "trex":
                tid, _idx, dur, size, flags = struct.unpack_from(">IIIII", data, s + 4)
                trex[tid] = (dur, size, flags)
    tracks: dict[int, Track] = {}
    for k, s, e in iter_boxes(data, *moov):
        if k != "trak":
            continue
        tkhd = _need(data, s, e, "tkhd")
        version = data[tkhd[0]]
        track_id = struct.unpack_from(">I", data, tkhd[0] + (20 if version == 1 else 12))[0]
        mdhd = _need(data, s, e, "mdia/mdhd")
        mv = data[mdhd[0]]
        timescale = struct.unpack_from(">I", data, mdhd[0] + (20 if mv == 1 else 12))[0]
        handler = data[_need(data, s, e, "mdia/hdlr")[0] + 8:][:4].decode("latin-1")
        media_time = 0
        elst = _child(data, *(_child(data, s, e, "edts") or (0, 0)), "elst") if _child(data, s, e, "edts") else None
        if elst:
            ev = data[elst[0]]
            entries = struct.unpack_from(">I", data, elst[0] + 4)[0]
            pos = elst[0] + 8
            for _ in range(entries):
                mt = struct.unpack_from(">q" if ev == 1 else ">i", data, pos + (8 if ev == 1 else 4))[0]
                pos += 20 if ev == 1 else 12
                if mt >= 0:  # skip empty edits
                    media_time = mt
                    break
        stsd = _need(data, s, e, "mdia/minf/stbl/stsd")
        entry = next(iter_boxes(data, stsd[0] + 8, stsd[1]))
        codec, es, ee = entry
        dur, size, flags = trex.get(track_id, (0, 0, 0))
        if handler == "vide":
            width, height = struct.unpack_from(">HH", data, es + 24)
            avcc = _child(data, es + 78, ee, "avcC")
            if avcc is None:
                raise ValueError(f"video track {track_id} ({codec}) has no avcC: only H.264 is supported")
            tracks[track_id] = Track(track_id, "video", codec, timescale, data[avcc[0]:avcc[1]], width=width,
                                     height=height, media_time=media_time, default_duration=dur,
                                     default_size=size, default_flags=flags)
        elif handler == "soun":
            channels = struct.unpack_from(">H", data, es + 16)[0]
            rate = struct.unpack_from(">I", data, es + 24)[0] >> 16
            esds = _child(data, es + 28, ee, "esds")
            if esds is None:
                raise ValueError(f"audio track {track_id} ({codec}) has no esds: only AAC is supported")
            tracks[track_id] = Track(track_id, "audio", codec, timescale, _audio_specific_config(data, *esds),
                                     sample_rate=rate or timescale, channels=channels, media_time=media_time,
                                     default_duration=dur, default_size=size, default_flags=flags)
    return tracks


def parse_fragment(data: bytes, tracks: dict[int, Track]) -> list[Sample]:
    """Samples of one ``moof``+``mdat`` (data starting at the moof), in file order per track."""
    boxes = list(iter_boxes(data))
    if not boxes or boxes[0][0] != "moof":
        raise ValueError("fragment does not start with a moof box")
    _, ms, me = boxes[0]
    moof_start = ms - 8
    out: list[Sample] = []
    for k, s, e in iter_boxes(data, ms, me):
        if k != "traf":
            continue
        tfhd = _need(data, s, e, "tfhd")
        flags = int.from_bytes(data[tfhd[0] + 1:tfhd[0] + 4], "big")
        track_id = struct.unpack_from(">I", data, tfhd[0] + 4)[0]
        track = tracks.get(track_id)
        if track is None:
            raise ValueError(f"fragment has a traf for track {track_id} that the init segment lacks")
        pos = tfhd[0] + 8
        if flags & 0x01:
            raise ValueError("tfhd base_data_offset is not supported; encode with default-base-is-moof")
        if flags & 0x02:
            pos += 4
        d_dur, d_size, d_flags = track.default_duration, track.default_size, track.default_flags
        if flags & 0x08:
            d_dur = struct.unpack_from(">I", data, pos)[0]
            pos += 4
        if flags & 0x10:
            d_size = struct.unpack_from(">I", data, pos)[0]
            pos += 4
        if flags & 0x20:
            d_flags = struct.unpack_from(">I", data, pos)[0]
        tfdt = _need(data, s, e, "tfdt")
        dts = struct.unpack_from(">Q" if data[tfdt[0]] == 1 else ">I", data, tfdt[0] + 4)[0]
        for kk, ts, _te in iter_boxes(data, s, e):
            if kk != "trun":
                continue
            version = data[ts]
            tflags = int.from_bytes(data[ts + 1:ts + 4], "big")
            count = struct.unpack_from(">I", data, ts + 4)[0]
            p = ts + 8
            offset = moof_start
            if tflags & 0x01:
                offset += struct.unpack_from(">i", data, p)[0]
                p += 4
            first_flags = None
            if tflags & 0x04:
                first_flags = struct.unpack_from(">I", data, p)[0]
                p += 4
            for i in range(count):
                dur, size, sflags, cto = d_dur, d_size, d_flags, 0
                if tflags & 0x100:
                    dur = struct.unpack_from(">I", data, p)[0]
                    p += 4
                if tflags & 0x200:
                    size = struct.unpack_from(">I", data, p)[0]
                    p += 4
                if tflags & 0x400:
                    sflags = struct.unpack_from(">I", data, p)[0]
                    p += 4
                elif i == 0 and first_flags is not None:
                    sflags = first_flags
                if tflags & 0x800:
                    cto = struct.unpack_from(">i" if version == 1 else ">I", data, p)[0]
                    p += 4
                if offset + size > len(data):
                    raise ValueError(f"trun sample {i} of track {track_id} points past the fragment's mdat")
                is_sync = track.kind == "audio" or not (sflags >> 16) & 1
                out.append(Sample(track_id, dts, cto, dur, data[offset:offset + size], is_sync))
                offset += size
                dts += dur
    return out
