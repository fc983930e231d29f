"""The MKV writer: structure as KVS wants it (parsed back element by element) and decodable by
FFmpeg (PyAV) with every frame of the source fMP4."""

from __future__ import annotations

import io

import pytest

from tests.integration.delivery_media import make_sample
from tests.integration.kvs_standin import (
    CLUSTER_ID,
    EBML_ID,
    SEGMENT_ID,
    SIMPLE_BLOCK_ID,
    TIMECODE_ID,
    TRACKS_ID,
    decode_mkv,
    find,
    parse_simple_block,
    read_element_header,
)
from worker.delivery.kvs.fmp4_reader import parse_fragment, parse_init
from worker.delivery.kvs.mkv import MkvStreamWriter, encode_size

TRACK_ENTRY, CODEC_ID, CODEC_PRIVATE, TRACK_NUMBER = 0xAE, 0x86, 0x63A2, 0xD7


def test_encode_size_boundaries() -> None:
    assert encode_size(0) == b"\x80"
    assert encode_size(126) == b"\xfe"
    assert encode_size(127) == b"\x40\x7f"  # 0xff alone would mean 'unknown'
    assert encode_size(2**14 - 2) == b"\x7f\xfe"
    assert len(encode_size(2**40)) == 6


def test_fmp4_parser_counts_every_sample() -> None:
    sample = make_sample(6.0)
    tracks = parse_init(sample.init.data)
    assert tracks[1].kind == "video" and tracks[1].codec_private[0] == 1  # avcC version 1
    assert tracks[2].kind == "audio" and tracks[2].sample_rate == 48000
    video = [s for f in sample.fragments for s in parse_fragment(f.data, tracks) if s.track_id == 1]
    assert len(video) == 150
    assert [s.is_sync for s in video].count(True) == len(sample.fragments)


def test_stream_layout_and_decode() -> None:
    sample = make_sample(6.0)
    writer = MkvStreamWriter(sample.init.data)
    header = writer.header()
    clusters = [writer.cluster(f.data) for f in sample.fragments]
    stream = io.BytesIO(header + b"".join(c.data for c in clusters))

    eid, size, _ = read_element_header(stream)  # type: ignore[misc]
    assert eid == EBML_ID
    assert find(stream.read(size), 0x4282) == [b"matroska"]
    eid, size, _ = read_element_header(stream)  # type: ignore[misc]
    assert (eid, size) == (SEGMENT_ID, -1)  # unknown size: it is a live stream
    seen = []
    timecodes = []
    while (h := read_element_header(stream)) is not None:
        eid, size, _ = h
        payload = stream.read(size)
        seen.append(eid)
        if eid == TRACKS_ID:
            entries = find(payload, TRACK_ENTRY)
            assert [find(e, CODEC_ID)[0] for e in entries] == [b"V_MPEG4/ISO/AVC", b"A_AAC"]
            assert [find(e, TRACK_NUMBER)[0] for e in entries] == [b"\x01", b"\x02"]
            assert find(entries[0], CODEC_PRIVATE)[0] == parse_init(sample.init.data)[1].codec_private
        if eid == CLUSTER_ID:
            timecodes.append(int.from_bytes(find(payload, TIMECODE_ID)[0], "big"))
            blocks = [parse_simple_block(b) for b in find(payload, SIMPLE_BLOCK_ID)]
            track, rel, flags, _ = blocks[0]
            assert (track, rel) == (1, 0) and flags & 0x80, "cluster must start with the video keyframe"
            assert all(not f & 0x80 for t, _, f, _ in blocks[1:] if t == 1)
            assert {t for t, *_ in blocks} == {1, 2}
    assert seen[:2] == [0x1549A966, TRACKS_ID] and seen.count(CLUSTER_ID) == len(sample.fragments)
    tracks = parse_init(sample.init.data)
    first_video = [next(s for s in parse_fragment(f.data, tracks) if s.track_id == 1) for f in sample.fragments]
    assert timecodes == [round((s.dts + s.cto) * 1000 / tracks[1].timescale) for s in first_video]
    assert all(600 <= b - a <= 680 for a, b in zip(timecodes[1:], timecodes[2:], strict=False))  # 16 frames = 640 ms
    assert [c.timecode_ms for c in clusters] == timecodes

    nv, na = decode_mkv(stream.getvalue())
    assert nv == 150 and na >= 280
    # each cluster alone after the header decodes too (what KVS and a late viewer need)
    assert decode_mkv(header + clusters[3].data)[0] == sample.fragments[3].num_frames


def test_rejects_fragment_without_leading_keyframe() -> None:
    sample = make_sample(6.0)
    writer = MkvStreamWriter(sample.init.data)
    with pytest.raises(ValueError, match="moof"):
        writer.cluster(sample.fragments[1].data[8:])
    with pytest.raises(ValueError):
        MkvStreamWriter(sample.init.data[:40] + b"\x00" * 8)
