"""Jobs: the job row (tables, store, leases), the Celery queue and the render task. See docs/jobs.md."""
