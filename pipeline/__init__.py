"""longtake's model-agnostic streaming framework: Module, Stage, Pipeline, schedule, encoding.

Nothing in this package knows of Celery, SQL or S3.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: idle OpenMP workers sleep instead of spinning. Inference shares the
# cores with the publisher thread (encoding, uploads) and, on shared machines, other processes;
# spinning workers starved them (measured 4x slower renders on a loaded 2-core machine). An explicit
# OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
