"""The import contracts of worker/ (pyproject ``[tool.importlinter]``, run by ``make test``) hold on
this tree, and fail on a copy of it with a deliberately circular import.

``lint-imports`` is run on a temporary copy of ``worker/`` with the repository's pyproject, so the
tree itself is never touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[2]


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("lint-imports")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "importlinter.cli"]
    return subprocess.run(
        [*cmd, "--no-cache"],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "worker", tmp_path / "worker", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_tree_keeps_its_import_contracts(tree: Path) -> None:
    res = _lint_imports(tree)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "worker-acyclic" not in res.stdout and "BROKEN" not in res.stdout


def test_a_circular_import_between_sub_packages_breaks_the_check(tree: Path) -> None:
    # delivery/ is imported by jobs/; delivery importing jobs back closes a circle (and breaks the layers)
    keys = tree / "worker" / "delivery" / "keys.py"
    keys.write_text(keys.read_text() + "\n\ndef _queue() -> object:\n    from worker.jobs import queue\n\n    return queue\n")
    res = _lint_imports(tree)
    assert res.returncode != 0
    assert "no sub-package or module imports in a circle" in res.stdout and "BROKEN" in res.stdout
    assert ".delivery -> .jobs" in res.stdout or ".jobs -> .delivery" in res.stdout, res.stdout


def test_a_circle_inside_a_sub_package_breaks_the_check(tree: Path) -> None:
    # what celery_app.py <-> tasks.py used to do, hidden in a function body
    tasks = tree / "worker" / "jobs" / "tasks.py"
    tasks.write_text(tasks.read_text() + "\n\ndef _app() -> object:\n    from worker.jobs import celery_app\n\n    return celery_app\n")
    res = _lint_imports(tree)
    assert res.returncode != 0 and "BROKEN" in res.stdout, res.stdout
