"""The registered model families, one folder each (``pipeline/families/<name>/``).

Adding a family = writing its folder (a :class:`~pipeline.model_family.ModelFamily`, its stages,
ports and module builder) and one line below. ``render()`` and the job spec resolve names here; the
framework core never imports this package. Importing it loads no torch (see ``pipeline.model_family``).
"""

from __future__ import annotations

from pipeline.families.tiny import TinyFamily
from pipeline.families.wan import WanFamily
from pipeline.model_family import FamilyRegistry

FAMILIES = FamilyRegistry()
"""Every family this process can render, by name."""

FAMILIES.register(TinyFamily())
FAMILIES.register(WanFamily())

DEFAULT_FAMILY = "tiny"
