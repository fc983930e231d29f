"""Structured logs: one JSON object per line, carrying the job id and chunk index when known.

Who calls: the worker process (Celery ``setup_logging`` signal in :mod:`worker.jobs.celery_app`), the
render child (:mod:`worker.jobs.runner`) and the CLI call :func:`configure_logging` once at start. Code
that works on a job wraps it in ``with job_context(job_id):`` and updates the chunk with
:func:`set_chunk`; every record logged inside gets ``job_id`` / ``chunk`` fields. A record may also
pass them explicitly with ``extra={"job_id": ..., "chunk": ...}``.

Context lives in a ``contextvars.ContextVar``: threads started inside a job (lease keeper, reaper)
set their own context; nothing here keeps references to jobs after the ``with`` block.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

_job_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("longtake_job_id", default=None)
_chunk: contextvars.ContextVar[int | None] = contextvars.ContextVar("longtake_chunk", default=None)

# attributes every LogRecord has; anything else a caller passed via ``extra`` is emitted as a field
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


@contextmanager
def job_context(job_id: str) -> Iterator[None]:
    """Tag every record logged inside (in this thread/context) with ``job_id``."""
    t1 = _job_id.set(job_id)
    t2 = _chunk.set(None)
    try:
        yield
    finally:
        _chunk.reset(t2)
        _job_id.reset(t1)


def set_chunk(index: int | None) -> None:
    """The chunk (emission) index the current job is working on, for the records that follow."""
    _chunk.set(index)


class ContextFilter(logging.Filter):
    """Copies the job id / chunk from the context onto records that do not carry them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "job_id", None) is None:
            record.job_id = _job_id.get()
        if getattr(record, "chunk", None) is None:
            record.chunk = _chunk.get()
        return True


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", "job_id", "chunk", ...extra, "exc"}`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out and value is not None:
                out[key] = value if isinstance(value, str | int | float | bool) else repr(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str = "INFO", *, json_lines: bool = True) -> None:
    """Replace the root handlers with one stderr handler (JSON or plain text) plus the context filter."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter())
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter(
                "%(asctime)s %(levelname)s %(name)s [job=%(job_id)s chunk=%(chunk)s] %(message)s"
            )
        )
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
