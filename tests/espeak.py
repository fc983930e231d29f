"""The mark for tests that need ``espeak-ng`` on PATH (``make test`` installs it; a bare checkout may
lack it): the held-out voices, which the benchmarks demand rather than fall back from."""

from __future__ import annotations

import pytest

from models.avatars.speech import espeak_available

needs_espeak = pytest.mark.skipif(not espeak_available(), reason="espeak-ng is not installed")
