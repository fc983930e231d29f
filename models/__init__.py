"""The model families' networks: plain ``nn.Module``s with no framework code (see docs/models.md).

Import the classes from their modules (``models.dit.A2VDiT``, ``models.wan.dit`` …). This package
itself imports nothing heavy, so torch-free readers of a family's configuration (the API and the
Celery parent validating a job spec through ``pipeline.families``) stay torch-free.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: idle OpenMP workers sleep instead of spinning. Inference shares the
# cores with the publisher thread (encoding, uploads) and, on shared machines, other processes;
# spinning workers starved them (measured 4x slower renders on a loaded 2-core machine). An explicit
# OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
