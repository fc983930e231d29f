"""LiveSchedule: the steps of a live render, released as its audio arrives.

The chunk loop (``Pipeline.run``) takes either a :class:`~pipeline.schedule.ChunkPlan` (a file: every
step known up front) or a :class:`LiveSchedule` (a live feed). The schedule walks the open-ended plan
(:class:`~pipeline.schedule.LiveChunkPlan`) one N chunk at a time: for ``N_k`` it waits on the
:class:`~pipeline.live_source.LiveAudioSource` until the audio the chunk needs has been converted
(``LiveChunkPlan.release_video_frames``), then releases ``N_k`` and ``I_{k-1}`` with the arrival
time of that audio. When the feed ends first, the rest comes from the whole plan of the final length.
While it waits it calls ``on_idle`` every :data:`IDLE_S`, so the loop reports published emissions
even when the next chunk's audio is late.

What it keeps across chunks: the chunk index and, once the feed ended, the final plan. Nothing grows
with the session.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pipeline.errors import InvalidInputError
from pipeline.live import LiveEnd
from pipeline.live_source import LiveAudioSource
from pipeline.schedule import ChunkPlan, LiveChunkPlan, PlanError, ReleasedStep, frames_for_audio

IDLE_S = 0.05
"""How often a wait for audio hands back to the loop (``on_idle``)."""


@dataclass
class LiveSchedule:
    """``plan`` over ``source``; ``sample_rate`` / ``fps``: the family preset's audio rate (the rate
    the source is waited at) and video rate."""

    plan: LiveChunkPlan
    source: LiveAudioSource
    sample_rate: int
    fps: int
    final: ChunkPlan | None = None  # the whole plan, once the feed ended

    def _samples(self, video_frames: int) -> int:
        return -(-video_frames * self.sample_rate // self.fps)

    def _feed_frames(self, samples: int) -> int:
        return -(-samples * self.source.meta.sample_rate // self.sample_rate)

    def released(self, on_idle: Callable[[], None] = lambda: None) -> Iterator[ReleasedStep]:
        """Every step, in execution order, each once the audio it needs is there (blocking)."""
        index, k = 0, 0
        while self.final is None or k < self.final.num_n_chunks:
            if self.final is None:
                need = self._samples(self.plan.release_video_frames(k))
                while not self.source.wait(need, self.sample_rate, timeout_s=IDLE_S):
                    on_idle()
                have = self.source.num_samples(self.sample_rate)
                if have < need:  # the feed ended before this chunk's audio: the rest is the whole plan
                    self.final = self._final_plan(have)
                    continue
                plan, is_final = self.plan.growing(k), False
            else:
                plan, is_final = self.final, True
                need = min(self._samples(self.plan.release_video_frames(k)), self.source.num_samples(self.sample_rate))
            arrival = self.source.arrival_time(min(self._feed_frames(need), self.source.available_frames()))
            for step in plan.chunk_steps(k):
                yield ReleasedStep(index, step, plan, is_final=is_final, arrival_t=arrival)
                index += 1
            k += 1

    def _final_plan(self, num_samples: int) -> ChunkPlan:
        end = self.source.end
        try:
            return self.plan.final(frames_for_audio(num_samples, self.sample_rate, self.fps))
        except PlanError as exc:
            reason = end.reason if end is not None else "?"
            raise InvalidInputError(
                f"audio {str(self.source.path)!r}: the live feed ended ({reason}) before any audio arrived; "
                "send at least one video frame of audio before closing it", field="audio") from exc

    @property
    def end(self) -> LiveEnd | None:
        return self.source.end
