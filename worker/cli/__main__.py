"""``python -m worker.cli`` (``longtake up`` starts its services this way)."""

from __future__ import annotations

import sys

from worker.cli import main

sys.exit(main())
