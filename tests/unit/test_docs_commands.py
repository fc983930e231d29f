"""The commands README.md and docs/ print work as printed on a fresh clone after `make demo`
(issue 18 item 6): no bare `longtake` before the venv is activated, no bare `python -m` (the venv's
python has the packages), every `LONGTAKE_*` variable they name is a real setting, and the service
section says how to point the services at PostgreSQL, Redis and S3. The commands themselves are run
by tests/unit/test_cli.py (the `up` banner) and tests/unit/test_render_cli.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from worker.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
CLONE_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # read on a fresh clone
DOCS = [*CLONE_DOCS, *sorted((ROOT / "ops").glob("*.md"))]  # ops/: run inside the images, their python
# read by tests and benchmarks themselves, not by Settings
NOT_SETTINGS = {"LONGTAKE_TEST_OUTAGE_S", "LONGTAKE_EVAL_THREADS", "LONGTAKE_EVAL_CHECKPOINT", "LONGTAKE_EVAL_OPTIONS",
                "LONGTAKE_QUALITY_PRESET", "LONGTAKE_FAKE_RENDER_LOG"}


def code_lines(path: Path) -> list[str]:
    """The lines of the fenced code blocks of ``path`` and of its inline `code`, in order."""
    lines: list[str] = []
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            lines.append(line.strip())
        else:
            lines.extend(m.strip() for m in re.findall(r"`([^`]+)`", line))
    return lines


def test_readme_runs_longtake_only_from_the_venv() -> None:
    activated = False
    for line in code_lines(ROOT / "README.md"):
        if line.startswith("source .venv/bin/activate"):
            activated = True
        command = line.split("#")[0]
        for part in re.split(r"&&|;|\|", command):
            first = part.split()[0] if part.split() else ""
            assert first != "longtake" or activated, (
                f"README runs `{line}` before `source .venv/bin/activate`: `longtake` is not on PATH "
                "after `make demo`; write .venv/bin/longtake or activate the venv first")


@pytest.mark.parametrize("path", CLONE_DOCS, ids=[str(p.relative_to(ROOT)) for p in CLONE_DOCS])
def test_docs_use_the_venvs_python(path: Path) -> None:
    bare = [ln for ln in code_lines(path) if re.search(r"(^|[\s(=])python3? -m ", ln)]
    assert not bare, f"{path.name}: use .venv/bin/python (the system python lacks the packages): {bare}"


def test_every_documented_variable_is_a_setting() -> None:
    fields = {f"LONGTAKE_{name.upper()}" for name in Settings.model_fields}
    for path in DOCS:
        named = set(re.findall(r"LONGTAKE_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
        unknown = sorted(named - fields - NOT_SETTINGS)
        assert not unknown, f"{path.name} names {unknown}, which worker/settings.py does not read"


def test_service_section_says_where_the_jobs_queue_and_outputs_live() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("As a service"): readme.index("## What is inside")]
    for name in ("LONGTAKE_DATABASE_URL", "LONGTAKE_BROKER_URL", "LONGTAKE_OBJECT_STORE_URL",
                 "LONGTAKE_S3_ENDPOINT_URL", "LONGTAKE_API_TOKENS", "LONGTAKE_API_URL", "LONGTAKE_API_TOKEN"):
        assert f"export {name}=" in section or f" {name}=" in section, name
