"""A small streaming Matroska writer for the KVS PutMedia body, laid out as the KVS producer does.

Stream = EBML header, then a Segment of unknown size holding Info (1 ms timecode scale), Tracks
(track 1 ``V_MPEG4/ISO/AVC`` with the avcC as CodecPrivate, track 2 ``A_AAC`` with the
AudioSpecificConfig) and then one Cluster per fMP4 fragment. Every cluster starts with the video
keyframe (FFmpeg's MKV muxer may start a cluster with audio, which KVS rejects as a fragment start),
followed by the fragment's other video and audio samples as SimpleBlocks in time order.

Who calls what: :class:`worker.delivery.kvs.sink.KVSPreviewSink` builds one :class:`MkvStreamWriter` from the
init segment, sends ``header()`` at the start of every PutMedia connection and ``cluster(fragment)``
for each fragment. Nothing is retained between calls but the track table.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from worker.delivery.kvs.fmp4_reader import Sample, Track, parse_fragment, parse_init

# Element ids (with their length markers, as written on the wire)
EBML = 0x1A45DFA3
EBML_VERSION, EBML_READ_VERSION, EBML_MAX_ID_LENGTH, EBML_MAX_SIZE_LENGTH = 0x4286, 0x42F7, 0x42F2, 0x42F3
DOC_TYPE, DOC_TYPE_VERSION, DOC_TYPE_READ_VERSION = 0x4282, 0x4287, 0x4285
SEGMENT, INFO, TIMECODE_SCALE, SEGMENT_UID, TITLE, MUXING_APP, WRITING_APP = (
    0x18538067, 0x1549A966, 0x2AD7B1, 0x73A4, 0x7BA9, 0x4D80, 0x5741)
TRACKS, TRACK_ENTRY, TRACK_NUMBER, TRACK_UID, TRACK_TYPE, CODEC_ID, CODEC_PRIVATE, TRACK_NAME = (
    0x1654AE6B, 0xAE, 0xD7, 0x73C5, 0x83, 0x86, 0x63A2, 0x536E)
DEFAULT_DURATION, VIDEO, PIXEL_WIDTH, PIXEL_HEIGHT, AUDIO, SAMPLING_FREQUENCY, CHANNELS = (
    0x23E383, 0xE0, 0xB0, 0xBA, 0xE1, 0xB5, 0x9F)
CLUSTER, TIMECODE, SIMPLE_BLOCK = 0x1F43B675, 0xE7, 0xA3
UNKNOWN_SIZE = b"\x01\xff\xff\xff\xff\xff\xff\xff"
TIMECODE_SCALE_NS = 1_000_000  # 1 ms, as KVS expects


def encode_id(element_id: int) -> bytes:
    return element_id.to_bytes((element_id.bit_length() + 7) // 8, "big")


def encode_size(n: int) -> bytes:
    """EBML variable-length size, shortest form (all-ones values are reserved for 'unknown')."""
    for length in range(1, 9):
        if n < (1 << (7 * length)) - 1:
            return (n | (1 << (7 * length))).to_bytes(length, "big")
    raise ValueError(f"EBML size {n} too large")


def element(element_id: int, payload: bytes) -> bytes:
    return encode_id(element_id) + encode_size(len(payload)) + payload


def uint(element_id: int, value: int) -> bytes:
    return element(element_id, value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big"))


def flt(element_id: int, value: float) -> bytes:
    return element(element_id, struct.pack(">d", value))


def text(element_id: int, value: str) -> bytes:
    return element(element_id, value.encode("utf-8"))


@dataclass(frozen=True)
class Cluster:
    """One MKV cluster made from one fMP4 fragment."""

    timecode_ms: int
    data: bytes
    num_video: int
    num_audio: int


class MkvStreamWriter:
    """fMP4 init + fragments -> MKV stream bytes (header once per connection, then clusters)."""

    def __init__(self, init_segment: bytes, *, title: str = "longtake preview") -> None:
        tracks = parse_init(init_segment)
        videos = [t for t in tracks.values() if t.kind == "video"]
        audios = [t for t in tracks.values() if t.kind == "audio"]
        if len(videos) != 1 or videos[0].codec != "avc1":
            raise ValueError(f"init segment must have exactly one H.264 (avc1) video track, got {list(tracks.values())}")
        if len(audios) > 1 or (audios and audios[0].codec != "mp4a"):
            raise ValueError("init segment may have at most one AAC (mp4a) audio track")
        self.video: Track = videos[0]
        self.audio: Track | None = audios[0] if audios else None
        self._tracks = tracks
        self._title = title
        # MKV track numbers as KVS wants them: video 1, audio 2
        self._mkv_track = {self.video.track_id: 1, **({self.audio.track_id: 2} if self.audio else {})}

    def header(self) -> bytes:
        ebml = element(EBML, b"".join([
            uint(EBML_VERSION, 1), uint(EBML_READ_VERSION, 1), uint(EBML_MAX_ID_LENGTH, 4),
            uint(EBML_MAX_SIZE_LENGTH, 8), text(DOC_TYPE, "matroska"), uint(DOC_TYPE_VERSION, 2),
            uint(DOC_TYPE_READ_VERSION, 2),
        ]))
        info = element(INFO, b"".join([
            uint(TIMECODE_SCALE, TIMECODE_SCALE_NS), element(SEGMENT_UID, os.urandom(16)), text(TITLE, self._title),
            text(MUXING_APP, "longtake"), text(WRITING_APP, "longtake"),
        ]))
        v = self.video
        entries = [element(TRACK_ENTRY, b"".join([
            uint(TRACK_NUMBER, 1), uint(TRACK_UID, 1), uint(TRACK_TYPE, 1), text(TRACK_NAME, "video"),
            text(CODEC_ID, "V_MPEG4/ISO/AVC"), element(CODEC_PRIVATE, v.codec_private),
            element(VIDEO, uint(PIXEL_WIDTH, v.width) + uint(PIXEL_HEIGHT, v.height)),
        ]))]
        if self.audio is not None:
            a = self.audio
            asc_channels = (a.codec_private[1] >> 3) & 0xF if len(a.codec_private) >= 2 else 0
            entries.append(element(TRACK_ENTRY, b"".join([
                uint(TRACK_NUMBER, 2), uint(TRACK_UID, 2), uint(TRACK_TYPE, 2), text(TRACK_NAME, "audio"),
                text(CODEC_ID, "A_AAC"), element(CODEC_PRIVATE, a.codec_private),
                element(AUDIO, flt(SAMPLING_FREQUENCY, float(a.sample_rate)) + uint(CHANNELS, asc_channels or a.channels)),
            ])))
        tracks = element(TRACKS, b"".join(entries))
        return ebml + encode_id(SEGMENT) + UNKNOWN_SIZE + info + tracks

    def _pts_ms(self, s: Sample) -> int:
        track = self._tracks[s.track_id]
        # the edit list shifts video by its composition delay; audio priming is left in (a preview
        # tolerates ~20 ms of A/V offset, and negative block times are what KVS rejects)
        shift = track.media_time if track.kind == "video" else 0
        return max(0, round((s.dts + s.cto - shift) * 1000 / track.timescale))

    def cluster(self, fragment: bytes) -> Cluster:
        samples = [s for s in parse_fragment(fragment, self._tracks) if s.track_id in self._mkv_track]
        video = [s for s in samples if s.track_id == self.video.track_id]
        if not video or not video[0].is_sync:
            raise ValueError("fMP4 fragment does not start with a video keyframe; KVS fragments must")
        key = video[0]
        base = self._pts_ms(key)
        vscale, ascale = self.video.timescale, (self.audio.timescale if self.audio else 1)
        rest = sorted(
            (s for s in samples if s is not key),
            key=lambda s: s.dts / (vscale if s.track_id == self.video.track_id else ascale),
        )
        blocks = []
        for s in [key, *rest]:
            rel = self._pts_ms(s) - base
            if not -32768 <= rel <= 32767:
                raise ValueError(f"fragment longer than 32 s (sample at +{rel} ms); use shorter emissions")
            flags = 0x80 if s.is_sync else 0x00
            payload = encode_size(self._mkv_track[s.track_id]) + struct.pack(">hB", rel, flags) + s.data
            blocks.append(element(SIMPLE_BLOCK, payload))
        body = uint(TIMECODE, base) + b"".join(blocks)
        return Cluster(base, element(CLUSTER, body), len(video), len(samples) - len(video))
