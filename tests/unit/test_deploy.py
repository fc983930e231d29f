"""The deployment files describe the system as it is (issue 14).

Static checks, no network, no Docker engine, no cluster: every YAML/JSON file parses; every
``LONGTAKE_*`` variable that compose or the manifests set is a ``Settings`` field and the values
build a valid ``Settings``; every command they run parses with the real ``longtake`` CLI parser;
every metric (and label) in the dashboard and the alert rules is exported by the worker's or the
API's registry; probe paths and ports are real routes and settings; kustomize overlays reference
files that exist (and render, when ``kubectl`` is installed); the Dockerfiles copy files that exist
and that ``.dockerignore`` does not exclude; the worker's termination grace exceeds one chunk plus
the ranks' stop; the API imports no torch.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
K8S = ROOT / "ops" / "k8s"
COMPOSE_FILES = [DOCKER / "compose.yml", DOCKER / "compose.gpu.yml"]
DOCKERFILES = [DOCKER / "worker.Dockerfile", DOCKER / "api.Dockerfile"]
ALERTS = ROOT / "ops" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "ops" / "grafana" / "dashboards" / "longtake.json"
RUNBOOK = ROOT / "ops" / "RUNBOOK.md"
LONGTAKE_SERVICES = ("migrate", "api", "worker")  # compose services running a longtake image

# Variables the files set that are not Settings fields, each read by something else.
OTHER_ENV = {
    "AWS_ACCESS_KEY_ID": "boto3 credentials (object store)",
    "AWS_SECRET_ACCESS_KEY": "boto3 credentials (object store)",
    "AWS_DEFAULT_REGION": "boto3 region (object store)",
}
# What the API image leaves out (docker/requirements-api.txt): the model stack. It keeps numpy, av
# and pillow for the media probe of uploads at submit, which imports them on its first probe only.
RENDER_ONLY = {"torch", "safetensors"}
RENDER_MODULES = ("torch", "numpy", "safetensors", "av", "PIL")  # none imported by `longtake api` at start


# ---------------------------------------------------------------------------------------------- helpers


def _yaml_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _k8s_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml"))


def _patch_files() -> set[Path]:
    out = set()
    for kfile in K8S.rglob("kustomization.yaml"):
        for p in yaml.safe_load(kfile.read_text()).get("patches", []):
            if "path" in p:
                out.add((kfile.parent / p["path"]).resolve())
    return out


def _k8s_objects(*, patches: bool = False) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Objects of every manifest file; with ``patches``, also the (partial) strategic-merge patches."""
    skip = set() if patches else _patch_files()
    for path in _k8s_files():
        if path.name == "kustomization.yaml" or path.resolve() in skip:
            continue
        for doc in _yaml_docs(path):
            yield path, doc


def _settings_fields() -> set[str]:
    from worker.settings import Settings

    return set(Settings.model_fields)


def _compose(path: Path = DOCKER / "compose.yml") -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _compose_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _pod_specs(*, patches: bool = False) -> Iterator[tuple[str, dict[str, Any]]]:
    for _path, obj in _k8s_objects(patches=patches):
        spec = obj.get("spec") or {}
        if obj.get("kind") in ("Deployment", "Job", "StatefulSet", "DaemonSet"):
            yield obj["metadata"]["name"], spec["template"]["spec"]


def _configmap_data() -> dict[str, str]:
    data: dict[str, str] = {}
    for _path, obj in _k8s_objects(patches=True):
        if obj.get("kind") == "ConfigMap":
            data.update({k: str(v) for k, v in (obj.get("data") or {}).items()})
    return data


def _container_env(container: dict[str, Any]) -> dict[str, str | None]:
    """name -> literal value (None when it comes from a Secret or a field reference)."""
    out: dict[str, str | None] = {}
    for e in container.get("env") or []:
        out[e["name"]] = str(e["value"]) if "value" in e else None
    return out


def _base_configmap() -> dict[str, str]:
    (cm,) = [o for o in _yaml_docs(K8S / "base" / "configmap.yaml") if o["kind"] == "ConfigMap"]
    return {k: str(v) for k, v in cm["data"].items()}


def _base_container(name: str) -> dict[str, Any]:
    for _path, obj in _k8s_objects():
        if obj.get("kind") == "Deployment" and obj["metadata"]["name"] == name and "base" in _path.parts:
            return obj["spec"]["template"]["spec"]["containers"][0]
    raise AssertionError(f"no Deployment {name} in ops/k8s/base")


def _base_pod(name: str) -> dict[str, Any]:
    for _path, obj in _k8s_objects():
        if obj.get("kind") == "Deployment" and obj["metadata"]["name"] == name and "base" in _path.parts:
            return obj["spec"]["template"]["spec"]
    raise AssertionError(f"no Deployment {name} in ops/k8s/base")


def _cli_commands() -> dict[str, Any]:
    import argparse

    from worker.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _parse_cli(argv: list[str]) -> None:
    from worker.cli import build_parser

    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on a bad command line
        raise AssertionError(f"`longtake {' '.join(argv)}` does not parse: exit {exc.code}") from exc


@contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """Exactly ``env`` as the LONGTAKE_* environment (Settings reads it as the services would)."""
    saved = dict(os.environ)
    for key in [k for k in os.environ if k.startswith("LONGTAKE_")]:
        del os.environ[key]
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _settings_from(env: dict[str, str]) -> Any:
    from worker.settings import Settings

    with _environ({k: v for k, v in env.items() if k.startswith("LONGTAKE_")}):
        return Settings()  # type: ignore[call-arg]


def _api_app(env: dict[str, str] | None = None) -> Any:
    from worker.api.app import create_app

    base = {
        "LONGTAKE_DATABASE_URL": "sqlite://",
        "LONGTAKE_BROKER_URL": "memory://",
        "LONGTAKE_OBJECT_STORE_URL": "file:///tmp/longtake-deploy-test",
    }
    return create_app(_settings_from({**base, **(env or {})}))


def _exported_metrics() -> dict[str, set[str]]:
    """Every sample name the worker and the API export -> the label names it may carry."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.registry import CollectorRegistry

    from worker.jobs import metrics as wm

    texts = [generate_latest(wm.REGISTRY).decode()]
    jobs = CollectorRegistry()
    jobs.register(wm.JobsByStatusCollector(lambda: {}))  # registered by the worker at its first job
    texts.append(generate_latest(jobs).decode())
    from fastapi.testclient import TestClient

    texts.append(TestClient(_api_app()).get("/metrics").text)

    labels_of: dict[str, set[str]] = {}
    for obj in [*vars(wm).values(), *vars(_api_app().state.deps.metrics).values()]:
        names = getattr(obj, "_labelnames", None)
        if names is not None and hasattr(obj, "_name"):
            labels_of[obj._name] = set(names)
    labels_of["longtake_jobs"] = {"status"}

    out: dict[str, set[str]] = {}
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("_sum", "_count", "_created"),
        "gauge": ("",),
    }
    for text in texts:
        for fam in text_string_to_metric_families(text):
            if not fam.name.startswith("longtake_"):
                continue
            for sfx in suffixes.get(fam.type, ("",)):
                labels = set(labels_of.get(fam.name, set()))
                if sfx == "_bucket":
                    labels.add("le")
                out[fam.name + sfx] = labels
    return out


_METRIC_RE = re.compile(r"\b(longtake_[a-z0-9_]+)\s*(\{[^}]*\})?")
_LABEL_RE = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)")
_SCRAPE_LABELS = {"job", "instance"}


def _promql_refs(expr: str) -> Iterator[tuple[str, set[str]]]:
    for m in _METRIC_RE.finditer(expr):
        labels = set(_LABEL_RE.findall(m.group(2) or ""))
        yield m.group(1), {name for name, _op in labels}


def _check_exprs(exprs: list[tuple[str, str]]) -> None:
    exported = _exported_metrics()
    assert exported, "no longtake_* metrics found in the registries"
    problems = []
    for where, expr in exprs:
        assert expr.count("(") == expr.count(")"), f"{where}: unbalanced parentheses in {expr!r}"
        for name, labels in _promql_refs(expr):
            if name not in exported:
                problems.append(f"{where}: {name} is not exported (exported: {sorted(exported)})")
                continue
            unknown = labels - exported[name] - _SCRAPE_LABELS
            if unknown:
                problems.append(f"{where}: {name} has no label(s) {sorted(unknown)}")
    assert not problems, "\n".join(problems)


def _anchor(heading: str) -> str:
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


# ---------------------------------------------------------------------------------------------- parsing


def test_every_yaml_and_json_file_parses() -> None:
    files = [*COMPOSE_FILES, ALERTS, *(ROOT / "ops").rglob("*.yml"), *_k8s_files()]
    for path in files:
        assert _yaml_docs(path), f"{path} is empty"
    for path in (ROOT / "ops" / "grafana").rglob("*.json"):
        json.loads(path.read_text())


def test_k8s_objects_are_well_formed() -> None:
    for path, obj in _k8s_objects():
        where = path.relative_to(ROOT)
        assert {"apiVersion", "kind", "metadata"} <= set(obj), f"{where}: not a Kubernetes object"
        assert obj["metadata"].get("name"), f"{where}: {obj['kind']} without a name"
        if obj["kind"] == "Deployment":
            sel = obj["spec"]["selector"]["matchLabels"]
            labels = obj["spec"]["template"]["metadata"]["labels"]
            assert sel.items() <= labels.items(), f"{where}: selector does not match the pod labels"


def test_manifests_validate_against_kubernetes_schemas() -> None:
    import kubernetes_validate as kv  # offline schemas (dev extra)
    for _path, obj in _k8s_objects():
        if obj["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: no built-in schema (its fields are held by the tests below)
        kv.validate(obj, "1.30.0", strict=True)


# ---------------------------------------------------------------------------------------------- settings


def test_compose_env_vars_are_settings_fields_and_valid() -> None:
    fields = _settings_fields()
    for path in COMPOSE_FILES:
        services = _compose(path)["services"]
        for name in LONGTAKE_SERVICES:
            if name not in services:
                continue
            env = _compose_env(services[name])
            for key in env:
                if key.startswith("LONGTAKE_"):
                    assert key[len("LONGTAKE_") :].lower() in fields, f"{path.name} {name}: {key} is not a Settings field"
                else:
                    assert key in OTHER_ENV, f"{path.name} {name}: {key} is neither a Settings field nor known"
    services = _compose()["services"]
    for name in LONGTAKE_SERVICES:
        _settings_from(_compose_env(services[name]))  # values parse and the validators pass
    api_env = _compose_env(services["api"])
    app = _api_app({k: v for k, v in api_env.items() if k in ("LONGTAKE_API_TOKENS", "LONGTAKE_API_PORT")})
    assert app.state.deps.auth.tenants, "the compose API has no usable token"  # length, JSON


def test_k8s_env_vars_are_settings_fields() -> None:
    fields = _settings_fields()
    keys: list[tuple[str, str]] = [("ConfigMap", k) for k in _configmap_data()]
    for pod, spec in _pod_specs(patches=True):
        for c in spec["containers"]:
            keys += [(pod, k) for k in _container_env(c)]
    for path in K8S.rglob("*.env"):  # generated Secrets hold values, their keys are not env names
        assert path.read_text().strip()
    for where, key in keys:
        if key.startswith("LONGTAKE_"):
            assert key[len("LONGTAKE_") :].lower() in fields, f"{where}: {key} is not a Settings field"
        else:
            assert key in OTHER_ENV, f"{where}: {key} is neither a Settings field nor known"


def test_k8s_worker_settings_build_and_grace_exceeds_chunk_plus_drain() -> None:
    worker_env = _container_env(_base_container("longtake-worker"))
    s = _settings_from({**_base_configmap(), **{k: v for k, v in worker_env.items() if v is not None}})
    assert s.node_ranks == 8 and s.node_device == "cuda"
    need = s.progress_timeout_s + s.cancel_grace_s + s.kill_grace_s
    grace = _base_pod("longtake-worker")["terminationGracePeriodSeconds"]
    assert grace > need, f"terminationGracePeriodSeconds={grace} must exceed one chunk + drain = {need}"
    # compose: stop_grace_period says the same
    m = re.fullmatch(r"(\d+)m", str(_compose()["services"]["worker"]["stop_grace_period"]))
    assert m and int(m.group(1)) * 60 > need


def test_secret_keys_referenced_exist_in_generated_secret() -> None:
    generated = {
        line.split("=", 1)[0]
        for line in (K8S / "overlays" / "cpu" / "secrets.env").read_text().splitlines()
        if line and not line.startswith("#")
    }
    referenced = set()
    for _pod, spec in _pod_specs():
        for c in spec["containers"]:
            for e in c.get("env") or []:
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == "longtake"
                    referenced.add(ref["key"])
    for _path, obj in _k8s_objects():
        if obj["kind"] == "TriggerAuthentication":
            referenced |= {r["key"] for r in obj["spec"]["secretTargetRef"]}
    assert referenced <= generated, f"keys missing from the dev Secret: {referenced - generated}"
    assert "docs/deploy.md" in (K8S / "base" / "kustomization.yaml").read_text()
    for key in referenced:
        assert key in (ROOT / "docs" / "deploy.md").read_text(), f"docs/deploy.md does not name secret key {key}"


# ---------------------------------------------------------------------------------------------- commands, ports, routes


def test_commands_are_real_cli_commands() -> None:
    commands = _cli_commands()
    for path in COMPOSE_FILES:
        for name, svc in _compose(path)["services"].items():
            if name in LONGTAKE_SERVICES and "command" in svc:
                assert svc["command"][0] in commands, f"{path.name} {name}: {svc['command']}"
                _parse_cli(svc["command"])
    for pod, spec in _pod_specs():
        for c in spec["containers"]:
            assert c["image"].startswith("longtake/"), f"{pod}: image {c['image']}"
            assert "command" not in c, f"{pod}: keep the image's ENTRYPOINT (tini -- longtake)"
            _parse_cli(c["args"])
    for dockerfile in DOCKERFILES:
        text = dockerfile.read_text()
        entry = json.loads(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1))  # type: ignore[union-attr]
        assert entry == ["tini", "--", "longtake"], f"{dockerfile.name}: ENTRYPOINT {entry}"
        cmd = json.loads(re.search(r"^CMD (.+)$", text, re.M).group(1))  # type: ignore[union-attr]
        _parse_cli(cmd)
    assert "longtake = \"worker.cli:main\"" in (ROOT / "pyproject.toml").read_text()


def _api_paths(app: Any) -> set[str]:
    """Every path the app routes, routers included (FastAPI keeps included routers as their own
    route objects, so ``app.routes`` alone lists only the app's own)."""
    paths: set[str] = set()

    def walk(routes: Any, prefix: str = "") -> None:
        for r in routes:
            if getattr(r, "path", None) is not None:
                paths.add(prefix + r.path)
            inner = getattr(r, "original_router", None) or getattr(r, "app", None)
            if inner is not None and hasattr(inner, "routes") and inner is not app:
                walk(inner.routes, prefix + getattr(inner, "prefix", ""))

    walk(app.routes)
    return paths


def test_probes_ports_and_scrape_paths_are_real() -> None:
    from worker.settings import Settings

    routes = _api_paths(_api_app())
    api = _base_container("longtake-api")
    ports = {p["name"]: p["containerPort"] for p in api["ports"]}
    assert api["readinessProbe"]["httpGet"]["path"] in routes
    assert ports[api["readinessProbe"]["httpGet"]["port"]] == 8000
    args = api["args"]
    assert int(args[args.index("--port") + 1]) == ports["http"]
    assert "/metrics" in routes and "/healthz" in routes
    api_pod = [o for _p, o in _k8s_objects() if o["kind"] == "Deployment" and o["metadata"]["name"] == "longtake-api"][0]
    assert api_pod["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"] in routes

    worker = _base_container("longtake-worker")
    env = _container_env(worker)
    assert int(env["LONGTAKE_METRICS_PORT"] or 0) == worker["ports"][0]["containerPort"]
    compose = _compose()["services"]
    assert _compose_env(compose["worker"])["LONGTAKE_METRICS_PORT"] == "9400"
    assert "9400:9400" in compose["worker"]["ports"] and "8000:8000" in compose["api"]["ports"]
    prom = yaml.safe_load((ROOT / "ops" / "prometheus" / "prometheus.yml").read_text())
    targets = {j["job_name"]: j["static_configs"][0]["targets"][0] for j in prom["scrape_configs"]}
    assert targets == {"longtake-api": "api:8000", "longtake-worker": "worker:9400"}
    assert all(j["metrics_path"] in routes for j in prom["scrape_configs"])
    assert Settings().api_port == 8000  # the images' and manifests' default


def test_worker_pod_shape() -> None:
    spec = _base_pod("longtake-worker")
    c = spec["containers"][0]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 8 == c["resources"]["limits"]["nvidia.com/gpu"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "nvidia.com/gpu.count", "operator": "In", "values": ["8"]} in terms[0]["matchExpressions"]
    assert spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    shm = [v for v in spec["volumes"] if v["name"] == "dshm"][0]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert int(_container_env(c)["LONGTAKE_NODE_RANKS"] or 0) == 8
    for _pod, pspec in _pod_specs():
        assert pspec["securityContext"]["runAsNonRoot"] is True
        for cont in pspec["containers"]:
            assert cont["securityContext"]["allowPrivilegeEscalation"] is False
    kinds = {o["kind"] for _p, o in _k8s_objects()}
    assert {"PodDisruptionBudget", "ScaledObject", "Job", "Service"} <= kinds


def test_scaledobject_counts_jobs_in_the_stable_view() -> None:
    """The KEDA query runs against a freshly migrated database and names real statuses."""
    import sqlalchemy as sa

    (so,) = [o for _p, o in _k8s_objects() if o["kind"] == "ScaledObject"]
    assert so["spec"]["scaleTargetRef"]["name"] == "longtake-worker"
    (trigger,) = so["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    from worker.jobs.db import migrate

    url = "sqlite:///" + str(Path(__import__("tempfile").mkdtemp()) / "keda.db")
    migrate(url)
    with sa.create_engine(url).connect() as conn:
        assert conn.execute(sa.text(query)).scalar_one() == 0
    from worker.jobs.metrics import JOB_STATUSES

    for status in re.findall(r"'(\w+)'", query):
        assert status in JOB_STATUSES


# ---------------------------------------------------------------------------------------------- metrics


def test_alert_rules_reference_exported_metrics_and_runbook_sections() -> None:
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    assert len(rules) >= 10
    _check_exprs([(r["alert"], r["expr"]) for r in rules])
    anchors = {_anchor(line[3:]) for line in RUNBOOK.read_text().splitlines() if line.startswith("## ")}
    for r in rules:
        link = r["annotations"]["runbook"]
        path, _, anchor = link.partition("#")
        assert path == "ops/RUNBOOK.md" and anchor in anchors, f"{r['alert']}: {link} (sections: {sorted(anchors)})"
        assert r["labels"]["severity"] in ("warning", "page")
    jobs = {j["job_name"] for j in yaml.safe_load((ROOT / "ops" / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]}
    for r in rules:
        for job in re.findall(r'job="([^"]+)"', r["expr"]):
            assert job in jobs


def test_dashboard_references_exported_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [
        (p["title"], t["expr"].replace("$__rate_interval", "5m").replace("$__range", "1h"))
        for p in dash["panels"]
        for t in p.get("targets", [])
    ]
    assert len(exprs) >= 15
    _check_exprs(exprs)
    ds = yaml.safe_load((ROOT / "ops" / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uids = {d["uid"] for d in ds["datasources"]}
    assert all(p["datasource"]["uid"] in uids for p in dash["panels"] if "datasource" in p)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    # the compose stack mounts the folders the provisioning files name
    prov = yaml.safe_load((ROOT / "ops" / "grafana" / "provisioning" / "dashboards" / "longtake.yml").read_text())
    vols = _compose()["services"]["grafana"]["volumes"]
    assert f"../ops/grafana/dashboards:{prov['providers'][0]['options']['path']}:ro" in vols


# ---------------------------------------------------------------------------------------------- files


def test_kustomizations_reference_existing_files() -> None:
    for kfile in K8S.rglob("kustomization.yaml"):
        k = yaml.safe_load(kfile.read_text())
        refs = list(k.get("resources", []))
        refs += [p["path"] for p in k.get("patches", []) if "path" in p]
        refs += [e for g in k.get("secretGenerator", []) for e in g.get("envs", [])]
        for ref in refs:
            assert (kfile.parent / ref).exists(), f"{kfile.relative_to(ROOT)}: {ref} does not exist"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (built-in kustomize) not installed")
def test_overlays_render_with_kustomize() -> None:
    for overlay in sorted((K8S / "overlays").iterdir()):
        out = subprocess.run(
            ["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=60, check=False
        )
        assert out.returncode == 0, f"{overlay.name}: {out.stderr}"
        objs = [d for d in yaml.safe_load_all(out.stdout) if d]
        ns = {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"}
        assert len(ns) == 1 and None not in ns, f"{overlay.name}: objects outside the overlay's namespace"
        names = {(o["kind"], o["metadata"]["name"]) for o in objs}
        assert ("Secret", "longtake") in names or overlay.name == "production"


def _dockerignore_patterns() -> list[str]:
    return [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]


def _ignored(rel: str) -> bool:
    ignored = False
    for pat in _dockerignore_patterns():
        neg = pat.startswith("!")
        pat = pat.lstrip("!")
        hit = any(
            fnmatch.fnmatch(cand, pat) or fnmatch.fnmatch(cand, pat.replace("**/", ""))
            for cand in [rel, *(str(Path(*Path(rel).parts[:i])) for i in range(1, len(Path(rel).parts)))]
        )
        if hit:
            ignored = not neg
    return ignored


def test_dockerfile_copy_sources_exist_and_are_not_ignored() -> None:
    for dockerfile in DOCKERFILES:
        for line in dockerfile.read_text().splitlines():
            if not line.startswith("COPY ") or "--from=" in line:
                continue
            *sources, _dest = line.split()[1:]
            for src in sources:
                assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src} does not exist"
                assert not _ignored(src), f"{dockerfile.name}: COPY {src} is excluded by .dockerignore"
        text = dockerfile.read_text()
        assert re.search(r"^USER 10001", text, re.M), f"{dockerfile.name}: not non-root"
        assert "HEALTHCHECK" in text
    assert (ROOT / "models" / "checkpoints" / "tiny.safetensors").exists()
    assert not _ignored("models/checkpoints/tiny.safetensors")
    assert _ignored("models/checkpoints/big-14b.safetensors") and _ignored(".git") and _ignored("tests")
    for path in COMPOSE_FILES:
        for svc in _compose(path)["services"].values():
            build = svc.get("build")
            if isinstance(build, dict):
                assert (DOCKER / build["context"] / build["dockerfile"]).resolve() in [d.resolve() for d in DOCKERFILES]
            for vol in svc.get("volumes", []):
                src = vol.split(":")[0]
                if src.startswith("."):
                    assert (DOCKER / src).exists(), f"{path.name}: volume source {src} does not exist"


def test_api_requirements_are_pyproject_minus_render_stack() -> None:
    import tomllib

    def name(req: str) -> str:
        return re.split(r"[\[<>=!~ ;]", req.strip(), maxsplit=1)[0].lower()

    deps = {name(d): d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    api = {
        name(line): line.strip()
        for line in (DOCKER / "requirements-api.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert set(api) == set(deps) - RENDER_ONLY, "docker/requirements-api.txt drifted from pyproject.toml"
    for n, line in api.items():
        assert line == deps[n], f"{n}: {line!r} vs pyproject {deps[n]!r}"


def test_api_and_migrate_do_not_import_the_render_stack() -> None:
    """What the API image leaves out is never imported by `longtake api`'s app or `longtake migrate`."""
    code = (
        "import sys, tempfile\n"
        "from worker.settings import Settings\n"
        "from worker.api.app import create_app\n"
        "from worker.jobs.queue import create_celery_app\n"
        "from worker.jobs.db import migrate\n"
        "s = Settings(database_url='sqlite:///' + tempfile.mkdtemp() + '/t.db', broker_url='memory://',\n"
        "             object_store_url='file:///tmp/longtake-deploy-test')\n"
        "migrate(s.database_url)\n"
        "from fastapi.testclient import TestClient\n"
        "c = TestClient(create_app(s, celery=create_celery_app(s)))\n"
        "assert c.get('/healthz').status_code == 200\n"
        f"print('IMPORTED:' + ','.join(m for m in {RENDER_MODULES!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False
    )
    assert out.returncode == 0, out.stderr
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("IMPORTED:")]
    assert line == "IMPORTED:", f"the API / migrate import the render stack: {line}"


def test_readme_links_the_deployment_guide() -> None:
    guide = (ROOT / "docs" / "deploy.md").read_text()
    assert "docs/deploy.md" in (ROOT / "README.md").read_text()
    for cmd in re.findall(r"^\s*(?:\$ )?(docker compose [^\n]+|kubectl kustomize [^\n]+)$", guide, re.M):
        for token in cmd.split():
            if token.startswith(("docker/", "ops/")):
                assert (ROOT / token).exists(), f"docs/deploy.md names {token}, which does not exist"
