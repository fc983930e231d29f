"""The Celery apps the integration harness starts (``celery -A celery_apps:<name> worker``).

Each is the production worker app (:func:`worker.jobs.celery_app.create_worker_app`) with a
renderer and a delivery injected into ``JobWorker``'s constructor, built from ``Settings()`` (the
harness' env) on first access.

- ``app``: the fake pipeline (:func:`fake_pipeline.render`) into the production delivery
  (progressive S3 sink into the local object store);
- ``hanging``: the fake pipeline into the production delivery whose sinks hang in one ``write``
  (:func:`fake_pipeline.hanging_delivery`, a worker stuck in a sink);
- ``real``: the production app as ``longtake worker`` builds it (the real pipeline).
"""

from __future__ import annotations

import fake_pipeline
from celery import Celery

from worker.jobs.celery_app import create_worker_app
from worker.settings import Settings

_apps: dict[str, Celery] = {}


def __getattr__(name: str) -> Celery:
    if name not in ("app", "hanging", "real"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _apps:
        if name == "hanging":
            _apps[name] = create_worker_app(
                Settings(), delivery=fake_pipeline.hanging_delivery, renderer=fake_pipeline.render
            )
        elif name == "real":
            _apps[name] = create_worker_app(Settings())
        else:
            _apps[name] = create_worker_app(Settings(), renderer=fake_pipeline.render)
    return _apps[name]
