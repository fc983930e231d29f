"""One committed output segment: the record the delivery makes and the job row keeps.

Who calls what: :class:`worker.delivery.s3_sink.S3ProgressiveSink` builds a :class:`SegmentRecord`
for each fragment once it is durable and hands it to ``on_commit``, which is
:meth:`worker.jobs.store.JobStore.commit_segment` (lease-fenced); ``JobStore.segments`` reads the
same records back, and a resumed sink takes them as ``committed=``. One shape end to end.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SegmentRecord:
    """One fragment durably delivered, as stored on the job's ``segments`` rows."""

    index: int
    key: str  # object key of the segment (preview on) or of the final MP4 (preview off)
    nbytes: int
    duration_s: float
    checksum: str  # sha256 hex of the fragment bytes
    state_key: str | None  # object key of the resume state taken right after it, if stored
    first_frame: int
    num_frames: int
