"""The worker's errors: subclasses of the project's :class:`pipeline.errors.RenderError`.

One hierarchy from the render to the job row: every error here has a stable ``code`` (stored on the
job row as ``error_code``), a ``retryable`` flag (whether another attempt may succeed) and a message
that names the field or object, the bad value and the fix. Who raises what:

- :class:`LeaseLostError` — :class:`worker.jobs.store.JobStore` when a fenced write matches no row;
  the task stops working on the job (it belongs to someone else now);
- :class:`StorageError` / :class:`ObjectNotFoundError` — the object stores of
  :mod:`worker.delivery.storage`; the progressive sink retries the retryable ones and turns the rest
  into a :class:`pipeline.errors.SinkError`.

The task (:mod:`worker.jobs.tasks`) and the runner read ``code`` and ``retryable`` from the
:class:`RenderError` they catch; nothing inspects attributes by name.
"""

from __future__ import annotations

from pipeline.errors import RenderError


class LeaseLostError(RenderError):
    """The caller's lease token no longer owns the job (another worker claimed it, or the job was
    finished/requeued). Nothing was written. The caller must stop working on the job."""

    code = "lease_lost"


class StorageError(RenderError):
    """An object store operation failed. ``retryable`` is True for throttling, 5xx and connection
    errors that survived the store's own bounded retries (a later attempt may still succeed)."""

    code = "storage_error"

    def __init__(self, message: str, *, op: str, key: str, retryable: bool) -> None:
        super().__init__(message, field=key)
        self.op = op
        self.key = key
        self.retryable = retryable


class ObjectNotFoundError(StorageError):
    """The key (or multipart upload id) does not exist."""

    code = "object_not_found"

    def __init__(self, message: str, *, op: str, key: str) -> None:
        super().__init__(message, op=op, key=key, retryable=False)
