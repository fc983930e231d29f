"""The layer rules fail the lint (and so ``make test``) on a wrong import.

The rules are ruff banned imports (TID251) per folder: ``pipeline/ruff.toml`` (the framework core
imports no family and no ``models/``), ``pipeline/families/ruff.toml`` (a family may import both),
``models/ruff.toml`` (no ``pipeline/``, no ``bench/``), on top of the root bans in ``pyproject.toml``
(no Celery, SQL, S3 or ``worker/`` in either). The checker runs on a copy of those config files with
deliberately wrong imports, and must name each one — and only those.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ("pyproject.toml", "pipeline/ruff.toml", "pipeline/families/ruff.toml", "models/ruff.toml")


def _ruff(cwd: Path, *paths: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "TID251",
                           "--output-format", "concise", *paths], cwd=cwd, capture_output=True, text=True)


def test_wrong_imports_fail_the_layer_check(tmp_path: Path) -> None:
    for cfg in CONFIGS:
        (tmp_path / cfg).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / cfg, tmp_path / cfg)
    files = {
        # framework core: a models/ import, a family import (also inside a function), Celery
        "pipeline/schedule_bad.py": "from models.dit import A2VDiT\n\n\ndef f():\n"
                                    "    from pipeline.families.tiny import TinyFamily\n\n"
                                    "    return A2VDiT, TinyFamily\n",
        "pipeline/placement/loaders_bad.py": "import models.checkpoint\nimport celery\n\nprint(models, celery)\n",
        # models/: the framework and the benchmarks
        "models/training/evaluate_bad.py": "from pipeline.schedule import ChunkPlan\nfrom bench.quality import load_audio\n"
                                           "\nprint(ChunkPlan, load_audio)\n",
        # allowed: a family imports models/ and the core; render() names the families
        "pipeline/families/mini/family.py": "from models.dit import A2VDiT\nfrom pipeline.stage import Stage\n"
                                            "\nprint(A2VDiT, Stage)\n",
        "pipeline/render.py": "from pipeline.families import FAMILIES\n\nprint(FAMILIES)\n",
        "pipeline/stage.py": "from pipeline.model_family import ModelFamily\n\nprint(ModelFamily)\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    out = _ruff(tmp_path, "pipeline", "models")
    assert out.returncode == 1, out.stdout + out.stderr
    reported = sorted(line.split(" TID251 ")[0] + " " + line.split("`")[1]  # file:line:col: banned name
                      for line in out.stdout.splitlines() if "TID251" in line)
    assert reported == [
        "models/training/evaluate_bad.py:1:1: pipeline",
        "models/training/evaluate_bad.py:2:1: bench",
        "pipeline/placement/loaders_bad.py:1:8: models",
        "pipeline/placement/loaders_bad.py:2:8: celery",
        "pipeline/schedule_bad.py:1:1: models",
        "pipeline/schedule_bad.py:5:5: pipeline.families",
    ], out.stdout
    assert "the framework core names no family" in out.stdout and "models/ know nothing of the framework" in out.stdout


def test_the_tree_keeps_its_layers() -> None:
    out = _ruff(ROOT, "pipeline", "models")
    assert out.returncode == 0, out.stdout + out.stderr
