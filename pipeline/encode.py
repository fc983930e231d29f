"""H.264 + AAC encoding of each emission into one self-contained fMP4 fragment.

The pipeline creates one :class:`FragmentEncoder` per render attempt, hands its ``init_segment`` to the
sinks before the first chunk, then calls :meth:`FragmentEncoder.encode` once per emission (see
``pipeline.schedule``) with that emission's RGB frames. ``encode`` returns the finished
:class:`~pipeline.media_types.Fragment` at once (no lag: the first segment can be uploaded while the
second chunk is still being generated) and keeps nothing of the frames.

Why every fragment is a fresh encoder session: a fragment's bytes then depend only on its own frames,
its audio and its index. A resumed render (a new process, ``start_frame > 0``) therefore reproduces the
interrupted render's fragments byte for byte, and the fragments already delivered stay valid.

* Video: libx264 through PyAV, yuv420p (BT.601 matrix, tagged in the SPS), ``tune=zerolatency`` (no
  B-frames, no lookahead, so packets come out as frames go in and decode order = presentation order),
  one IDR at the start of each fragment, threads pinned (x264's output depends on its thread count, so
  an automatic count would make a resume on a different machine produce different bytes).
* Audio: AAC-LC mono (FFmpeg's native encoder). AAC frames (1024 samples) are on a global grid of the
  output timeline: frame ``j`` decodes to output samples ``[1024 j, 1024 (j+1))``. A fragment carries
  the frames whose start falls inside its video time range (so audio and video in one fragment differ
  by less than one AAC frame, 21 ms at 48 kHz), the last fragment carries the tail. Each fragment's
  frames come from a fresh AAC encoder that is first fed ``_AAC_PREROLL_FRAMES`` frames of the real
  preceding audio, so the overlap-add across fragment boundaries sees the true signal and no priming
  gap; the encoder's 1024-sample priming delay is removed by picking packets by their pts, so no edit
  list is needed and audio is sample-aligned with video. The last AAC frame's duration is shortened so
  the track lasts exactly as long as the input audio.
"""

from __future__ import annotations

import logging
from fractions import Fraction

import av
import numpy as np
from av.codec.context import Flags

from pipeline import fmp4
from pipeline.errors import InvalidInputError
from pipeline.inputs import AudioReader
from pipeline.media_types import Fragment, InitSegment

logger = logging.getLogger(__name__)

AAC_FRAME = 1024
_AAC_PREROLL_FRAMES = 2  # real audio fed before a fragment's first kept frame (MDCT overlap + psy model)
_AAC_LOOKAHEAD_FRAMES = 2  # fed after its last kept frame, so the kept frames are encoded as in a long run


def video_timescale(fps: int) -> int:
    return 90000 if 90000 % fps == 0 else fps * 1000


class FragmentEncoder:
    """Encodes emissions (RGB frames + the matching span of ``audio``) into fMP4 fragments.

    ``audio`` is read, never owned: the caller closes it after the render; a live source
    (``LiveAudioSource``) is waited on for each fragment's span. ``audio=None`` gives a
    video-only stream. ``crf`` is x264's constant rate factor (lower = better, 18-28 sensible);
    ``preset`` trades speed for size. ``start_frame`` is where a resumed render continues; it only
    serves as a check on the first ``encode`` call, because a fragment's bytes never depend on it.
    """

    def __init__(
        self,
        width: int,
        height: int,
        fps: int,
        audio: AudioReader | None,
        *,
        output_rate: int = 48000,
        crf: int = 23,
        preset: str = "fast",
        threads: int = 1,
        audio_bitrate: int = 128000,
        start_frame: int = 0,
    ) -> None:
        if width % 2 or height % 2 or width < 16 or height < 16:
            raise InvalidInputError(
                f"output size {width}x{height} cannot be encoded as H.264 4:2:0: width and height must be "
                "even and at least 16; choose an even resolution",
                field="resolution",
            )
        if not 1 <= fps <= 240:
            raise InvalidInputError(f"fps={fps} is out of range; use 1..240", field="fps")
        if not 0 <= crf <= 51:
            raise InvalidInputError(
                f"crf={crf} is out of range; use 0..51 (23 is x264's default)", field="crf"
            )
        self.width, self.height, self.fps = width, height, fps
        self.audio = audio
        self.output_rate = output_rate
        self.crf, self.preset, self.threads = crf, preset, threads
        self.audio_bitrate = audio_bitrate
        self.start_frame = start_frame
        self._next_frame: int | None = start_frame
        self._video_timescale = video_timescale(fps)
        self._frame_duration = self._video_timescale // fps
        self._init = self._build_init()

    # ------------------------------------------------------------------------------------ init

    @property
    def init_segment(self) -> InitSegment:
        return self._init

    def _build_init(self) -> InitSegment:
        ctx = self._open_video()
        avcc, video_codec = fmp4.avcc_box(bytes(ctx.extradata or b""))
        tracks = [
            fmp4.TrackSpec(
                fmp4.VIDEO_TRACK_ID,
                b"vide",
                self._video_timescale,
                fmp4.avc1_entry(self.width, self.height, avcc),
                self.width,
                self.height,
            )
        ]
        audio_codec = ""
        if self.audio is not None:
            actx = self._open_audio()
            asc = bytes(actx.extradata or b"")
            audio_codec = fmp4.aac_codec_string(asc)
            entry = fmp4.mp4a_entry(self.output_rate, 1, fmp4.esds_box(asc, self.audio_bitrate))
            tracks.append(fmp4.TrackSpec(fmp4.AUDIO_TRACK_ID, b"soun", self.output_rate, entry))
        return InitSegment(
            data=fmp4.init_segment(tracks),
            width=self.width,
            height=self.height,
            fps=self.fps,
            sample_rate=self.output_rate,
            video_codec=video_codec,
            audio_codec=audio_codec,
        )

    def _open_video(self) -> av.VideoCodecContext:
        ctx = av.CodecContext.create("libx264", "w")
        assert isinstance(ctx, av.VideoCodecContext)
        ctx.width, ctx.height, ctx.pix_fmt = self.width, self.height, "yuv420p"
        ctx.time_base = Fraction(1, self.fps)
        ctx.framerate = Fraction(self.fps)
        ctx.flags |= Flags.global_header  # SPS/PPS in extradata (-> avcC), not only in-band
        ctx.gop_size = 1 << 30  # one IDR per fragment: each fragment is its own session
        ctx.thread_count = self.threads
        ctx.options = {
            "preset": self.preset,
            "tune": "zerolatency",
            "crf": str(self.crf),
            # No scene-cut IDRs (keeps fragment sizes predictable); colour tags match the BT.601
            # conversion swscale does, with sRGB's BT.709 primaries and transfer.
            "x264-params": f"scenecut=0:threads={self.threads}:colorprim=bt709:transfer=bt709:colormatrix=smpte170m",
        }
        ctx.open()
        return ctx

    def _open_audio(self) -> av.AudioCodecContext:
        ctx = av.CodecContext.create("aac", "w")
        assert isinstance(ctx, av.AudioCodecContext)
        ctx.sample_rate, ctx.layout, ctx.format = self.output_rate, "mono", "fltp"
        ctx.bit_rate = self.audio_bitrate
        ctx.time_base = Fraction(1, self.output_rate)
        ctx.flags |= Flags.global_header  # AudioSpecificConfig in extradata (-> esds)
        ctx.open()
        return ctx

    # ---------------------------------------------------------------------------------- encode

    def encode(
        self,
        frames_THWC: np.ndarray,
        *,
        first_frame: int,
        index: int,
        is_last: bool,
        resume_state: bytes | None = None,
    ) -> Fragment:
        """Encode one emission: ``frames_THWC`` (uint8 RGB) are frames ``first_frame ..`` of the video.

        Emissions must come in timeline order without gaps (checked). Returns the complete fragment.
        """
        if (
            frames_THWC.dtype != np.uint8
            or frames_THWC.ndim != 4
            or frames_THWC.shape[1:]
            != (
                self.height,
                self.width,
                3,
            )
        ):
            raise ValueError(
                f"frames_THWC must be uint8 of shape (T, {self.height}, {self.width}, 3), "
                f"got {frames_THWC.dtype} {frames_THWC.shape}"
            )
        num_frames = frames_THWC.shape[0]
        if num_frames == 0:
            raise ValueError("an emission must have at least one frame")
        if self._next_frame is not None and first_frame != self._next_frame:
            raise ValueError(f"expected the emission starting at frame {self._next_frame}, got {first_frame}")
        self._next_frame = None if is_last else first_frame + num_frames

        runs = [self._video_run(frames_THWC, first_frame)]
        if self.audio is not None:
            runs.append(self._audio_run(first_frame, first_frame + num_frames, is_last))
        data = fmp4.fragment(index + 1, runs)
        return Fragment(
            index=index,
            data=data,
            first_frame=first_frame,
            num_frames=num_frames,
            start_s=first_frame / self.fps,
            duration_s=num_frames / self.fps,
            is_last=is_last,
            resume_state=resume_state,
        )

    def _video_run(self, frames_THWC: np.ndarray, first_frame: int) -> fmp4.TrackRun:
        ctx = self._open_video()
        encoded: list[tuple[int, bytes, bool]] = []  # (pts, Annex B bytes, keyframe)
        for t in range(frames_THWC.shape[0]):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frames_THWC[t]), format="rgb24")
            frame = frame.reformat(format="yuv420p")
            frame.pts = t
            encoded += [(int(p.pts or 0), bytes(p), p.is_keyframe) for p in ctx.encode(frame)]
        encoded += [(int(p.pts or 0), bytes(p), p.is_keyframe) for p in ctx.encode(None)]
        if len(encoded) != frames_THWC.shape[0]:
            raise RuntimeError(f"libx264 returned {len(encoded)} packets for {frames_THWC.shape[0]} frames")
        encoded.sort()  # zerolatency: already in order (no B-frames), so decode order == presentation order
        return fmp4.TrackRun(
            track_id=fmp4.VIDEO_TRACK_ID,
            base_decode_time=first_frame * self._frame_duration,
            samples=[fmp4.avcc_sample(data) for _, data, _ in encoded],
            durations=[self._frame_duration] * len(encoded),
            flags=[fmp4.SAMPLE_FLAGS_SYNC if key else fmp4.SAMPLE_FLAGS_NON_SYNC for _, _, key in encoded],
        )

    def _audio_sample(self, frame_index: int) -> int:
        """First output-rate audio sample of video frame ``frame_index``."""
        return frame_index * self.output_rate // self.fps

    def _audio_run(self, first_frame: int, end_frame: int, is_last: bool) -> fmp4.TrackRun:
        assert self.audio is not None
        j0 = -(-self._audio_sample(first_frame) // AAC_FRAME)
        j1 = -(-self._audio_sample(end_frame) // AAC_FRAME)
        # a live source grows: wait for the samples this fragment encodes (the whole feed for the last)
        self.audio.wait(None if is_last else (j1 + _AAC_LOOKAHEAD_FRAMES) * AAC_FRAME, self.output_rate)
        total = self.audio.num_samples(self.output_rate)
        num_aac = -(-total // AAC_FRAME)
        j1 = min(num_aac if is_last else j1, num_aac)
        if j1 <= j0:
            return fmp4.TrackRun(fmp4.AUDIO_TRACK_ID, j0 * AAC_FRAME, [], [])
        start = (j0 - _AAC_PREROLL_FRAMES) * AAC_FRAME
        stop = (j1 + _AAC_LOOKAHEAD_FRAMES) * AAC_FRAME
        pcm = self.audio.read(start, stop, self.output_rate)
        ctx = self._open_audio()
        # A packet with pts p decodes to input samples [p, p + 1024) (the encoder's priming is the
        # packet with pts -1024), i.e. to output samples start + p.
        by_frame: dict[int, bytes] = {}
        for k in range(0, len(pcm) + 1, AAC_FRAME):
            if k < len(pcm):
                frame = av.AudioFrame.from_ndarray(pcm[None, k : k + AAC_FRAME], format="fltp", layout="mono")
                frame.sample_rate = self.output_rate
                frame.pts = k
                packets = ctx.encode(frame)
            else:
                packets = ctx.encode(None)
            by_frame.update(
                {(start + int(p.pts)) // AAC_FRAME: bytes(p) for p in packets if p.pts is not None}
            )
        missing = [j for j in range(j0, j1) if j not in by_frame]
        if missing:
            raise RuntimeError(f"AAC encoder produced no packet for frames {missing[:5]}")
        durations = [AAC_FRAME] * (j1 - j0)
        if j1 == num_aac:
            durations[-1] = total - (num_aac - 1) * AAC_FRAME  # the track ends where the input ends
        return fmp4.TrackRun(
            track_id=fmp4.AUDIO_TRACK_ID,
            base_decode_time=j0 * AAC_FRAME,
            samples=[by_frame[j] for j in range(j0, j1)],
            durations=durations,
        )
