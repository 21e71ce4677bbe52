"""The deployment files in deploy/: Kubernetes manifests against the API schemas,
the compose file, the Dockerfile and the systemd units, and every mesh command line
in them against the real argument parsers (so a renamed flag breaks this test)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from coordinator.cli import build_parser as coordinator_parser
from mesh.settings import SECTIONS, resolve
from stage.cli import build_parser as stage_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.33.0"
TLS_FLAGS = ("--tls-cert", "--tls-key", "--tls-ca")


def parse_mesh_command(argv: list[str]) -> SimpleNamespace:
    """Parse ``mesh-coordinator ...`` or ``mesh-stage ...`` with the real parser; the
    settings of the configuration tree are resolved from the flags alone (no
    environment, no config file: they are not on this machine)."""
    program, *rest = argv
    parser = {"mesh-coordinator": coordinator_parser, "mesh-stage": stage_parser}[
        Path(program).name
    ]()
    args = parser.parse_args(rest)
    values = dict(vars(args))
    sections = {"up": ("coordinator", "stage", "frontend"), "join": ("stage", "frontend")}
    for section in sections.get(args.command, ()):
        cls = SECTIONS[section]
        given = {f.name: values[f.name] for f in fields(cls) if f.name in values}
        resolved = resolve(cls, section, given, {}, env={})
        values |= {f.name: getattr(resolved.value, f.name) for f in fields(cls) if f.name in given}
        values |= {
            f.name: getattr(resolved.value, f.name)
            for f in fields(cls)
            if f.name not in values and _takes(parser, args.command, f.name)
        }
    return SimpleNamespace(**values)


def _takes(parser, command: str, name: str) -> bool:
    """Whether ``command``'s parser has the flag of setting ``name``."""
    sub = parser._subparsers._group_actions[0].choices[command]
    return any(action.dest == name for action in sub._actions)


# ---- Kubernetes ----------------------------------------------------------------------


def k8s_documents() -> list[dict]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_k8s_manifests_match_the_api_schemas() -> None:
    import kubernetes_validate

    docs = k8s_documents()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "Deployment",
        "Namespace",
        "PersistentVolumeClaim",
        "Service",
        "Service",
        "Service",
        "StatefulSet",
    ]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "mesh"


def test_k8s_token_comes_from_a_secret_and_services_select_pods() -> None:
    docs = k8s_documents()
    workloads = {
        d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")
    }
    assert set(workloads) == {"mesh-coordinator", "mesh-stage"}
    for workload in workloads.values():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        token = env["MESH_JOIN_TOKEN"]
        assert "value" not in token
        assert token["valueFrom"]["secretKeyRef"] == {"name": "mesh-join-token", "key": "token"}
        assert "token" not in " ".join(container.get("args", [])).replace("--join-token", "")
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "mesh-tls"
        assert mounts["tls"] == "/etc/mesh/tls"
    stateful = workloads["mesh-stage"]
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    headless = services[stateful["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    for service in services.values():
        selector = service["spec"]["selector"]
        targets = [
            w
            for w in workloads.values()
            if {k: v for k, v in selector.items() if not k.startswith("statefulset.")}.items()
            <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(targets) == 1, service["metadata"]["name"]
        ports = {
            p["name"] for p in targets[0]["spec"]["template"]["spec"]["containers"][0]["ports"]
        }
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports


def test_k8s_coordinator_command_parses() -> None:
    (deployment,) = [d for d in k8s_documents() if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = parse_mesh_command([*container["command"], *container["args"]])
    assert args.command == "up" and args.no_local_stage and args.tls_mutual
    assert args.listen.endswith(":7070")


def test_k8s_stage_script_gives_pod_0_the_frontend(tmp_path: Path) -> None:
    """Run the StatefulSet's shell script with a stand-in mesh-stage that prints its
    arguments, then parse them with the real parser."""
    (stateful,) = [d for d in k8s_documents() if d["kind"] == "StatefulSet"]
    (container,) = stateful["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["sh", "-c"]
    (script,) = container["args"]
    fake = tmp_path / "mesh-stage"
    fake.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    fake.chmod(0o755)
    parsed = {}
    for pod in ("mesh-stage-0", "mesh-stage-1"):
        env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "POD_NAME": pod, "MESH_DEVICE": "cpu"}
        out = subprocess.run(
            ["sh", "-c", script], env=env, capture_output=True, text=True, check=True
        ).stdout
        parsed[pod] = parse_mesh_command(["mesh-stage", *out.splitlines()])
    first, second = parsed["mesh-stage-0"], parsed["mesh-stage-1"]
    assert first.frontend and first.api_key_file == Path("/etc/mesh/api-key/key")
    assert not second.frontend and second.api_key_file is None
    assert (
        second.advertise == f"mesh-stage-1.{stateful['spec']['serviceName']}.mesh.svc.cluster.local"
    )
    assert second.coordinator == "mesh-coordinator.mesh.svc.cluster.local:7070"
    assert second.tls_mutual and second.join_token_file is None


# ---- compose -------------------------------------------------------------------------


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())


def test_compose_runs_one_coordinator_and_two_stages_with_token_and_tls() -> None:
    spec = compose()
    services = spec["services"]
    assert set(services) == {"certs", "coordinator", "stage0", "stage1"}
    certs_command = " ".join(services["certs"]["command"])
    hosts = re.search(r"--hosts (\S+)", certs_command).group(1).split(",")
    parsed = {
        name: parse_mesh_command(services[name]["command"]) for name in services if name != "certs"
    }
    coordinator = parsed["coordinator"]
    assert (
        coordinator.command == "up" and coordinator.no_local_stage and coordinator.min_stages == 2
    )
    port = coordinator.listen.rsplit(":", 1)[1]
    tls = {(a.tls_cert, a.tls_key, a.tls_ca, a.tls_mutual) for a in parsed.values()}
    assert len(tls) == 1 and next(iter(tls))[3] is True
    for name, args in parsed.items():
        service = services[name]
        assert args.join_token_file == Path("/run/secrets/join_token")
        assert "join_token" in service["secrets"]
        assert any(v.startswith("tls:/etc/mesh/tls") for v in service["volumes"])
        assert service["depends_on"]["certs"]["condition"] == "service_completed_successfully"
        assert name in hosts
        if name != "coordinator":
            assert args.coordinator == f"coordinator:{port}"
            assert args.advertise == name
    assert parsed["stage0"].frontend and not parsed["stage1"].frontend
    assert parsed["stage0"].api_key_file == Path("/run/secrets/api_key")
    assert services["stage0"]["ports"] == ["8000:8000"]
    for secret in spec["secrets"].values():
        assert secret["file"].startswith("./secrets/")
    assert "secrets/" in (DEPLOY / "compose" / ".gitignore").read_text().split()
    build = services["coordinator"]["build"]
    context = (DEPLOY / "compose" / build["context"]).resolve()
    assert context == ROOT and (context / build["dockerfile"]).is_file()
    assert "TORCH_SPEC" in build["args"]


# ---- container -----------------------------------------------------------------------


def test_dockerfile_installs_the_project_with_a_torch_build_arg() -> None:
    text = (DEPLOY / "container" / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert lines[0].startswith("FROM python:3.11")
    assert any(line.startswith("ARG TORCH_SPEC=") for line in lines)
    assert re.search(r'pip install --index-url "\$\{TORCH_INDEX_URL\}" "\$\{TORCH_SPEC\}"', text)
    assert "pip install ." in text
    ignore = (DEPLOY / "container" / "Dockerfile.dockerignore").read_text().split()
    for line in lines:
        if line.startswith("COPY "):
            *sources, _dest = line.split()[1:]
            for source in sources:
                assert (ROOT / source).exists(), source
                assert f"!{source}" in ignore or f"!{source}/" in ignore, source
    (user,) = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert re.fullmatch(r"[1-9][0-9]*:[0-9]+", user)


# ---- systemd -------------------------------------------------------------------------


def exec_start(unit: Path, env_file: Path, instance: str = "0") -> list[str]:
    """ExecStart as systemd would run it: ``${VAR}`` is one word, ``$VAR`` splits."""
    env = {}
    for line in env_file.read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    (line,) = [x for x in unit.read_text().splitlines() if x.startswith("ExecStart=")]
    words: list[str] = []
    for word in shlex.split(line.removeprefix("ExecStart=")):
        word = word.replace("%i", instance).replace("%H", "worker-1")
        if re.fullmatch(r"\$[A-Z_]+", word):
            words += env.get(word[1:], "").split()
        else:
            words.append(re.sub(r"\$\{([A-Z_]+)\}", lambda m: env[m.group(1)], word))
    return words


def test_systemd_units_take_the_token_from_an_environment_file() -> None:
    units = DEPLOY / "systemd"
    coordinator = units / "mesh-coordinator.service"
    stage = units / "mesh-stage@.service"
    for unit in (coordinator, stage):
        text = unit.read_text()
        assert "EnvironmentFile=/etc/mesh/join-token.env" in text
        assert "MESH_JOIN_TOKEN" not in next(x for x in text.splitlines() if "ExecStart" in x)
    up = parse_mesh_command(exec_start(coordinator, units / "coordinator.env.example"))
    assert up.command == "up" and up.tls_mutual and up.min_stages == 3
    join = parse_mesh_command(exec_start(stage, units / "stage.env.example"))
    assert join.command == "join" and join.node_id == "worker-1-0" and join.tls_mutual
    assert join.coordinator.endswith(":7070") and join.device == "cuda:0"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not found")
def test_systemd_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """`systemd-analyze verify` wants the ExecStart binaries to exist: point them at
    this environment's entry points."""
    bin_dir = Path(sys.executable).parent
    for entry in ("mesh-coordinator", "mesh-stage"):
        assert (bin_dir / entry).exists(), f"{entry} is not installed in {bin_dir}"
    for unit in (DEPLOY / "systemd").glob("*.service"):
        text = unit.read_text().replace("/opt/mesh/venv/bin/", f"{bin_dir}/")
        (tmp_path / unit.name).write_text(text)
    (tmp_path / "mesh-stage@0.service").symlink_to(tmp_path / "mesh-stage@.service")
    result = subprocess.run(
        [
            "systemd-analyze",
            "verify",
            "--man=no",
            str(tmp_path / "mesh-coordinator.service"),
            str(tmp_path / "mesh-stage@0.service"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stderr
