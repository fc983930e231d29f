"""The error hierarchy every layer raises and the worker maps onto job rows.

One base, :class:`RenderError`, with a ``retryable`` flag and a stable ``code`` that the worker stores
on the job row. Messages name the field or input, the bad value and the fix.
"""

from __future__ import annotations


class RenderError(Exception):
    """Base of every error a render can end with."""

    code: str = "render_error"
    retryable: bool = False

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return self.message


class InvalidInputError(RenderError):
    """A request input (image, audio, text, option) cannot be used. Never retried."""

    code = "invalid_input"


class ModuleLoadError(RenderError):
    """A model or its checkpoint could not be loaded (missing file, bad keys, shape mismatch)."""

    code = "module_load"


class OutOfMemoryError(RenderError):
    """The device or host ran out of memory for the configured chunk size."""

    code = "out_of_memory"
    retryable = True


class SinkError(RenderError):
    """A sink (file, HLS, upload, live preview) failed to accept output."""

    code = "sink_error"
    retryable = True


class CancelledError(RenderError):
    """The render was cancelled between chunks."""

    code = "cancelled"


class PipelineBuildError(RenderError):
    """Stage wiring is inconsistent (missing or mistyped port); raised when the pipeline is built."""

    code = "pipeline_build"


class LiveFeedError(RenderError):
    """A live session's audio feed broke: its directory is inconsistent, or it stopped growing
    without an end (the feeder died). Sessions are not resumable, so never retried."""

    code = "live_feed"


class ResumeStateError(InvalidInputError):
    """``render(resume_state=...)`` got a snapshot this render cannot continue: unreadable, of another
    snapshot version, or made for another plan or with other options, another model, seed, text or
    reference image (``differs`` names what: ``"plan"``, ``"options.steps"``, ``"weights"``, ...).
    Continuing would change the video's method or model at the seam. A direct caller renders again
    without ``resume_state``; the worker does that itself, after discarding the segments made under
    the snapshot (docs/jobs.md, "Resume")."""

    code = "resume_mismatch"

    def __init__(self, message: str, *, differs: tuple[str, ...] = ()) -> None:
        super().__init__(message, field="resume_state")
        self.differs = differs  # kept when pickled across the rank pipe (BaseException keeps __dict__)
