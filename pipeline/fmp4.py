"""ISO BMFF boxes for CMAF-style fragmented MP4: the init segment and one ``moof`` + ``mdat`` per fragment.

Called only by :class:`pipeline.encode.FragmentEncoder`. We write the boxes ourselves because libavformat's
mp4 muxer (and so PyAV) only emits a fragment when the *next* keyframe arrives (``frag_keyframe``), and
PyAV exposes no way to force a fragment flush; that one-fragment lag would delay the first playable
segment by a whole chunk. Writing boxes directly makes every fragment complete the moment its samples are
encoded, and makes the bytes a pure function of the samples (no creation times, no muxer state), which
is what lets a resumed render reproduce an interrupted one byte for byte.

Layout: track 1 = H.264 video (``avc1`` + ``avcC``), track 2 = AAC-LC audio (``mp4a`` + ``esds``), optional.
Every fragment is one ``moof`` (``mfhd`` + one ``traf`` per track with samples: ``tfhd``
default-base-is-moof, ``tfdt`` v1, ``trun``) followed by one ``mdat`` (video samples, then audio).
References: ISO/IEC 14496-12 (boxes), 14496-15 (avcC), 14496-1 (esds descriptors), 23000-19 (CMAF).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

VIDEO_TRACK_ID = 1
AUDIO_TRACK_ID = 2

# trun sample_flags (14496-12 8.8.3.1): a sync sample depends on nothing; others depend on earlier
# samples and are marked non-sync so players only start decoding at keyframes.
SAMPLE_FLAGS_SYNC = 0x02000000
SAMPLE_FLAGS_NON_SYNC = 0x01010000

_UNITY_MATRIX = struct.pack(">9I", 0x00010000, 0, 0, 0, 0x00010000, 0, 0, 0, 0x40000000)
_LANGUAGE_UND = 0x55C4  # "und" packed as three 5-bit letters


def box(kind: bytes, *payload: bytes) -> bytes:
    body = b"".join(payload)
    return struct.pack(">I4s", 8 + len(body), kind) + body


def full_box(kind: bytes, version: int, flags: int, *payload: bytes) -> bytes:
    return box(kind, struct.pack(">I", (version << 24) | flags), *payload)


# ----------------------------------------------------------------------------------------- H.264


def split_annexb(data: bytes) -> list[bytes]:
    """NAL units of an Annex B byte stream (start codes 00 00 01 or 00 00 00 01), without start codes."""
    nals: list[bytes] = []
    i = data.find(b"\x00\x00\x01")
    while i >= 0:
        start = i + 3
        nxt = data.find(b"\x00\x00\x01", start)
        end = len(data) if nxt < 0 else nxt
        nal = data[start:end]
        if nxt >= 0 and nal.endswith(b"\x00"):  # the 4-byte start code's leading zero
            nal = nal[:-1]
        if nal:
            nals.append(nal)
        i = nxt
    return nals


def nal_type(nal: bytes) -> int:
    return nal[0] & 0x1F


def avcc_sample(annexb_packet: bytes) -> bytes:
    """An encoder packet (Annex B) as an MP4 sample: 4-byte length-prefixed NAL units.

    Parameter sets (7, 8), SEI (6) and access unit delimiters (9) are dropped: SPS/PPS live in
    ``avcC``, and x264's only SEI is its version/options banner, which would otherwise be repeated in
    every fragment (each fragment is a fresh encoder session).
    """
    out = bytearray()
    for nal in split_annexb(annexb_packet):
        if nal_type(nal) in (6, 7, 8, 9):
            continue
        out += struct.pack(">I", len(nal)) + nal
    return bytes(out)


def avcc_box(extradata: bytes) -> tuple[bytes, str]:
    """``avcC`` (14496-15 5.3.3) from libx264's Annex B global header, and the RFC 6381 codec string."""
    nals = split_annexb(extradata)
    sps = [n for n in nals if nal_type(n) == 7]
    pps = [n for n in nals if nal_type(n) == 8]
    if len(sps) != 1 or len(pps) != 1:
        raise ValueError(
            f"expected one SPS and one PPS in the H.264 global header, got {len(sps)}/{len(pps)}"
        )
    profile, compat, level = sps[0][1], sps[0][2], sps[0][3]
    body = bytearray([1, profile, compat, level, 0xFC | 3, 0xE0 | 1])
    body += struct.pack(">H", len(sps[0])) + sps[0]
    body += bytes([1]) + struct.pack(">H", len(pps[0])) + pps[0]
    if profile in (100, 110, 122, 144):
        # High profiles carry chroma format and bit depths; our encoder is fixed at 4:2:0 8-bit.
        body += bytes([0xFC | 1, 0xF8 | 0, 0xF8 | 0, 0])
    return box(b"avcC", bytes(body)), f"avc1.{profile:02x}{compat:02x}{level:02x}"


# ------------------------------------------------------------------------------------------- AAC


def _descriptor(tag: int, payload: bytes) -> bytes:
    size = len(payload)
    # 4-byte expandable size, as ffmpeg writes it: every decoder accepts it.
    length = bytes(
        [0x80 | (size >> 21) & 0x7F, 0x80 | (size >> 14) & 0x7F, 0x80 | (size >> 7) & 0x7F, size & 0x7F]
    )
    return bytes([tag]) + length + payload


def esds_box(audio_specific_config: bytes, avg_bitrate: int) -> bytes:
    dec_specific = _descriptor(0x05, audio_specific_config)
    # objectTypeIndication 0x40 = MPEG-4 audio; streamType 5 (audio) << 2 | upstream 0 | reserved 1.
    dec_config = _descriptor(
        0x04, struct.pack(">BB3sII", 0x40, 0x15, b"\x00\x00\x00", avg_bitrate, avg_bitrate) + dec_specific
    )
    sl_config = _descriptor(0x06, b"\x02")
    es = _descriptor(0x03, struct.pack(">HB", AUDIO_TRACK_ID, 0) + dec_config + sl_config)
    return full_box(b"esds", 0, 0, es)


def aac_codec_string(audio_specific_config: bytes) -> str:
    return f"mp4a.40.{audio_specific_config[0] >> 3}"


# -------------------------------------------------------------------------------------- init segment


@dataclass(frozen=True)
class TrackSpec:
    """One track of the init segment: ``sample_entry`` is a complete ``avc1`` or ``mp4a`` box."""

    track_id: int
    handler: bytes  # b"vide" or b"soun"
    timescale: int
    sample_entry: bytes
    width: int = 0
    height: int = 0


def avc1_entry(width: int, height: int, avcc: bytes) -> bytes:
    return box(
        b"avc1",
        bytes(6),
        struct.pack(">H", 1),  # reserved, data_reference_index
        bytes(16),  # pre_defined, reserved, pre_defined[3]
        struct.pack(">HHIIIH", width, height, 0x00480000, 0x00480000, 0, 1),
        bytes(32),  # compressorname
        struct.pack(">Hh", 0x0018, -1),
        avcc,
        box(b"pasp", struct.pack(">II", 1, 1)),
    )


def mp4a_entry(sample_rate: int, channels: int, esds: bytes) -> bytes:
    return box(
        b"mp4a",
        bytes(6),
        struct.pack(">H", 1),
        bytes(8),
        struct.pack(">HHHHI", channels, 16, 0, 0, sample_rate << 16),
        esds,
    )


def _trak(track: TrackSpec) -> bytes:
    is_video = track.handler == b"vide"
    tkhd = full_box(
        b"tkhd",
        0,
        0x3,  # enabled | in_movie
        struct.pack(">IIIII", 0, 0, track.track_id, 0, 0),
        bytes(8),
        struct.pack(">hhhH", 0, 0, 0 if is_video else 0x0100, 0),
        _UNITY_MATRIX,
        struct.pack(">II", track.width << 16, track.height << 16),
    )
    mdhd = full_box(b"mdhd", 0, 0, struct.pack(">IIIIHH", 0, 0, track.timescale, 0, _LANGUAGE_UND, 0))
    name = b"VideoHandler\x00" if is_video else b"SoundHandler\x00"
    hdlr = full_box(b"hdlr", 0, 0, struct.pack(">I4s", 0, track.handler), bytes(12), name)
    media_header = full_box(b"vmhd", 0, 1, bytes(8)) if is_video else full_box(b"smhd", 0, 0, bytes(4))
    dinf = box(b"dinf", full_box(b"dref", 0, 0, struct.pack(">I", 1), full_box(b"url ", 0, 1)))
    stbl = box(
        b"stbl",
        full_box(b"stsd", 0, 0, struct.pack(">I", 1), track.sample_entry),
        full_box(b"stts", 0, 0, struct.pack(">I", 0)),
        full_box(b"stsc", 0, 0, struct.pack(">I", 0)),
        full_box(b"stsz", 0, 0, struct.pack(">II", 0, 0)),
        full_box(b"stco", 0, 0, struct.pack(">I", 0)),
    )
    return box(b"trak", tkhd, box(b"mdia", mdhd, hdlr, box(b"minf", media_header, dinf, stbl)))


def init_segment(tracks: Sequence[TrackSpec]) -> bytes:
    """``ftyp`` + ``moov`` with empty sample tables and ``mvex``; no times, so the bytes are stable."""
    ftyp = box(b"ftyp", b"iso6", struct.pack(">I", 0), b"iso6cmfcisomdashmp41avc1")
    mvhd = full_box(
        b"mvhd",
        0,
        0,
        struct.pack(">IIII", 0, 0, 1000, 0),
        struct.pack(">IH", 0x00010000, 0x0100),
        bytes(10),
        _UNITY_MATRIX,
        bytes(24),
        struct.pack(">I", max(t.track_id for t in tracks) + 1),
    )
    trex = [full_box(b"trex", 0, 0, struct.pack(">IIIII", t.track_id, 1, 0, 0, 0)) for t in tracks]
    return ftyp + box(b"moov", mvhd, *(_trak(t) for t in tracks), box(b"mvex", *trex))


# ----------------------------------------------------------------------------------------- fragments


@dataclass(frozen=True)
class TrackRun:
    """The samples of one track in one fragment. ``flags`` None = all sync (audio)."""

    track_id: int
    base_decode_time: int  # in the track's timescale
    samples: Sequence[bytes]
    durations: Sequence[int]
    flags: Sequence[int] | None = None


def _traf(run: TrackRun, data_offset: int) -> bytes:
    tfhd = full_box(b"tfhd", 0, 0x020000, struct.pack(">I", run.track_id))  # default-base-is-moof
    tfdt = full_box(b"tfdt", 1, 0, struct.pack(">Q", run.base_decode_time))
    has_flags = run.flags is not None
    trun_flags = 0x001 | 0x100 | 0x200 | (0x400 if has_flags else 0)
    entries = bytearray()
    for i, (sample, duration) in enumerate(zip(run.samples, run.durations, strict=True)):
        entries += struct.pack(">II", duration, len(sample))
        if run.flags is not None:
            entries += struct.pack(">I", run.flags[i])
    trun = full_box(b"trun", 0, trun_flags, struct.pack(">Ii", len(run.samples), data_offset), bytes(entries))
    return box(b"traf", tfhd, tfdt, trun)


def fragment(sequence_number: int, runs: Iterable[TrackRun]) -> bytes:
    """One ``moof`` + ``mdat``; the runs' samples are laid out in the ``mdat`` in the order given."""
    runs = [r for r in runs if r.samples]

    def moof(offsets: Sequence[int]) -> bytes:
        mfhd = full_box(b"mfhd", 0, 0, struct.pack(">I", sequence_number))
        return box(b"moof", mfhd, *(_traf(r, o) for r, o in zip(runs, offsets, strict=True)))

    # Offsets are relative to the start of the moof and do not change its size: size it once with
    # zeros, then write it with the real offsets.
    moof_size = len(moof([0] * len(runs)))
    offsets, position = [], moof_size + 8
    for r in runs:
        offsets.append(position)
        position += sum(len(s) for s in r.samples)
    payload = b"".join(s for r in runs for s in r.samples)
    return moof(offsets) + box(b"mdat", payload)
