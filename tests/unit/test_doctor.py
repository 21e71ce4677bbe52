"""`mesh-coordinator doctor` and `mesh-stage doctor`: a good setup passes, each broken
part is a FAIL that says what is wrong, and the exit code is 1 exactly then.

Run both in-process (`main([...])`, JSON) and as the installed console scripts."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from package_support import rehash

from coordinator import cli as coordinator_cli
from mesh.package.manifest import layer_path
from stage import cli as stage_cli

BIN = Path(sys.executable).parent


@pytest.fixture
def package(tiny_package_factory, tmp_path) -> Path:
    target = tmp_path / "pkg"
    shutil.copytree(tiny_package_factory("llama", layers=2), target)
    return target


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A CA and a node certificate for 127.0.0.1, made by `mesh-coordinator certs`."""
    out = tmp_path_factory.mktemp("certs")
    subprocess.run(
        [BIN / "mesh-coordinator", "certs", "--out", out, "--hosts", "127.0.0.1"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out


@pytest.fixture
def token_file(tmp_path) -> Path:
    path = tmp_path / "token"
    path.write_text("a-long-random-secret\n")
    return path


def tls_args(certs: Path, cert: str = "node-127.0.0.1.pem") -> list[str]:
    return [
        "--tls-cert",
        str(certs / cert),
        "--tls-key",
        str(certs / "node-127.0.0.1-key.pem"),
        "--tls-ca",
        str(certs / "ca.pem"),
    ]


def good_args(package: Path, certs: Path, token_file: Path) -> list[str]:
    return [
        "--model",
        str(package),
        "--listen",
        "127.0.0.1:0",
        "--http-port",
        "0",
        "--prefix-cache-mb",
        "64",
        "--join-token-file",
        str(token_file),
        *tls_args(certs),
    ]


class Checks(list):
    """The doctor's results in order; ``checks["tls"]`` is the one result of that name."""

    def __getitem__(self, name):  # noqa: ANN001
        if not isinstance(name, str):
            return super().__getitem__(name)
        (found,) = [c for c in self if c["check"] == name]
        return found

    def names(self) -> set[str]:
        return {c["check"] for c in self}


def coordinator_doctor(argv: list[str], capsys) -> tuple[int, Checks]:
    code = coordinator_cli.main(["doctor", "--json", *argv])
    body = json.loads(capsys.readouterr().out)
    assert body["ok"] == (code == 0)
    return code, Checks(body["checks"])


def stage_doctor(argv: list[str], capsys) -> tuple[int, Checks]:
    code = stage_cli.main(["doctor", "--json", *argv])
    body = json.loads(capsys.readouterr().out)
    assert body["ok"] == (code == 0)
    return code, Checks(body["checks"])


def only_failure(checks: Checks) -> dict:
    (failure,) = [c for c in checks if c["status"] == "FAIL"]
    return failure


# ---- mesh-coordinator doctor ------------------------------------------------------------


def test_good_setup_passes_every_check(package, certs, token_file, capsys):
    code, checks = coordinator_doctor(good_args(package, certs, token_file), capsys)
    assert code == 0
    assert {c["status"] for c in checks} == {"PASS"}, checks
    assert [c["check"] for c in checks].count("port") == 2  # --listen and --http-port
    assert {"config", "package", "draft model", "join token", "tls", "memory"} <= checks.names()
    assert "sha256 and safetensors headers verified" in checks["package"]["detail"]
    assert "names 127.0.0.1" in checks["tls"]["detail"]


def test_console_script_good_setup_exits_0(package, certs, token_file):
    result = subprocess.run(
        [BIN / "mesh-coordinator", "doctor", *good_args(package, certs, token_file)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1].startswith("no check failed:")
    assert all(line.startswith("PASS  ") for line in lines[:-1]), result.stdout


def test_console_script_truncated_safetensors_with_matching_hash(package, certs, token_file):
    path = package / layer_path(1)
    path.write_bytes(path.read_bytes()[:-64])
    rehash(package, layer_path(1))
    result = subprocess.run(
        [BIN / "mesh-coordinator", "doctor", *good_args(package, certs, token_file)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert line.split()[1] == "package"
    assert f"{layer_path(1)}: safetensors header: the file is" in line and "(truncated)" in line
    assert "mesh-package build" in line
    assert result.stdout.splitlines()[-1].startswith("some checks failed:")


def test_corrupted_file(package, certs, token_file, capsys):
    path = package / layer_path(0)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    code, checks = coordinator_doctor(good_args(package, certs, token_file), capsys)
    assert code == 1
    failure = only_failure(checks)
    assert failure["check"] == "package"
    assert f"{layer_path(0)}: sha256" in failure["detail"]


def test_bad_toml_key_is_named(package, certs, token_file, tmp_path, capsys):
    config = tmp_path / "mesh.toml"
    config.write_text("[frontend]\nhttp_prot = 8000\n")
    argv = [*good_args(package, certs, token_file), "--config", str(config)]
    code, checks = coordinator_doctor(argv, capsys)
    assert code == 1
    assert checks["config"]["status"] == "FAIL"
    assert "unknown key(s) http_prot in [frontend]" in checks["config"]["detail"]


def test_bad_toml_value_is_named(package, tmp_path, capsys):
    config = tmp_path / "mesh.toml"
    config.write_text('[coordinator]\nkv_max_sessions = "many"\n')
    code, checks = coordinator_doctor(["--model", str(package), "--config", str(config)], capsys)
    assert code == 1
    assert "coordinator.kv_max_sessions from" in checks["config"]["detail"]


def test_unreadable_tls_file(package, certs, token_file, tmp_path, capsys):
    argv = good_args(package, certs, token_file)
    argv[argv.index("--tls-cert") + 1] = str(tmp_path / "missing.pem")
    code, checks = coordinator_doctor(argv, capsys)
    assert code == 1
    assert checks["tls"]["status"] == "FAIL"
    assert f"cannot read TLS file {tmp_path / 'missing.pem'}" in checks["tls"]["detail"]


def expired_certificate(certs: Path, out: Path) -> Path:
    """A node certificate for 127.0.0.1 signed by the test CA that expired yesterday."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    ca = x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((certs / "ca-key.pem").read_bytes(), None)
    key = serialization.load_pem_private_key((certs / "node-127.0.0.1-key.pem").read_bytes(), None)
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=30))
        .not_valid_after(now - datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    out.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return out


def test_expired_certificate(package, certs, token_file, tmp_path, capsys):
    expired = expired_certificate(certs, tmp_path / "expired.pem")
    argv = good_args(package, certs, token_file)
    argv[argv.index("--tls-cert") + 1] = str(expired)
    code, checks = coordinator_doctor(argv, capsys)
    assert code == 1
    assert only_failure(checks)["check"] == "tls"
    assert f"{expired} expired on" in checks["tls"]["detail"]
    assert "mesh-coordinator certs" in checks["tls"]["fix"]


def test_certificate_not_naming_the_advertised_address(package, certs, token_file, capsys):
    argv = [*good_args(package, certs, token_file), "--advertise", "head.example"]
    code, checks = coordinator_doctor(argv, capsys)
    assert code == 1
    failure = only_failure(checks)
    assert failure["check"] == "tls"
    assert "names 127.0.0.1, not head.example (--advertise)" in failure["detail"]


def test_certificate_from_another_ca(package, certs, token_file, tmp_path, capsys):
    other = tmp_path / "other-ca"
    subprocess.run(
        [BIN / "mesh-coordinator", "certs", "--out", other, "--hosts", "127.0.0.1"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    argv = good_args(package, certs, token_file)
    argv[argv.index("--tls-ca") + 1] = str(other / "ca.pem")
    code, checks = coordinator_doctor(argv, capsys)
    assert code == 1
    assert "is not signed by the CA" in only_failure(checks)["detail"]


def test_port_in_use(package, certs, token_file, capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        argv = good_args(package, certs, token_file)
        argv[argv.index("--listen") + 1] = f"127.0.0.1:{port}"
        code, checks = coordinator_doctor(argv, capsys)
    assert code == 1
    failure = only_failure(checks)
    assert failure["check"] == "port"
    assert f"--listen 127.0.0.1:{port} is in use by pid {os.getpid()}" in failure["detail"]


def test_a_taken_udp_port_warns_that_discovery_will_be_off(package, certs, token_file, capsys):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        argv = good_args(package, certs, token_file)
        argv[argv.index("--listen") + 1] = f"127.0.0.1:{port}"
        code, checks = coordinator_doctor(argv, capsys)
        _, quiet = coordinator_doctor([*argv, "--no-discovery"], capsys)
    assert code == 0  # a warning: the mesh serves without discovery
    assert checks["udp port"]["status"] == "WARN"
    assert "LAN discovery will be off" in checks["udp port"]["detail"]
    assert "udp port" not in quiet.names()


def test_console_script_http_port_in_use(package, certs, token_file):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        argv = good_args(package, certs, token_file)
        argv[argv.index("--http-port") + 1] = str(port)
        result = subprocess.run(
            [BIN / "mesh-coordinator", "doctor", *argv],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert result.returncode == 1
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert f"--http-port 127.0.0.1:{port} is in use" in line
    assert "choose another --http-port" in line


def test_cuda_device_this_host_lacks(package, certs, token_file, capsys):
    missing = f"cuda:{torch.cuda.device_count()}"
    argv = [*good_args(package, certs, token_file), "--device", missing]
    code, checks = coordinator_doctor(argv, capsys)
    assert code == 1
    failure = checks[f"device {missing}"]
    assert failure["status"] == "FAIL" and f"--device {missing}" in failure["detail"]
    assert checks["memory"]["status"] == "WARN"  # not measured on a device that is absent


def test_cpu_device_reports_cores_and_memory(package, certs, token_file, capsys):
    code, checks = coordinator_doctor(good_args(package, certs, token_file), capsys)
    assert code == 0
    assert f"cpu: {os.cpu_count()} cores" in checks["device cpu"]["detail"]
    assert "RAM" in checks["device cpu"]["detail"]


def test_memory_plan_that_cannot_fit(package, certs, token_file, capsys):
    """KV for 100000 sessions of 100000 positions: terabytes, on any host."""
    argv = good_args(package, certs, token_file)
    argv += ["--kv-max-sessions", "100000", "--max-tokens-per-session", "100000"]
    code, checks = coordinator_doctor(argv, capsys)
    assert code == 1
    failure = only_failure(checks)
    assert failure["check"] == "memory"
    assert "KV for 100000 session(s) x 100000 positions" in failure["detail"]
    assert "it cannot fit" in failure["detail"] and "--kv-max-sessions" in failure["fix"]


def test_the_local_stages_memory_is_what_up_gives_them(
    package, certs, token_file, capsys, monkeypatch
):
    """``up`` passes its local stages no MESH_STAGE_* variable: MESH_STAGE_MEMORY in the
    doctor's environment changes nothing, as it changes nothing for ``up`` (before,
    the doctor planned with it: a FAIL for a setup ``up`` runs)."""
    code, plain = coordinator_doctor(good_args(package, certs, token_file), capsys)
    monkeypatch.setenv("MESH_STAGE_MEMORY", "1KiB")
    code_with, stated = coordinator_doctor(good_args(package, certs, token_file), capsys)
    assert code_with == code
    assert stated["memory"]["status"] == plain["memory"]["status"]
    # The plan and the need are the same (the memory available may move between runs).
    assert stated["memory"]["detail"].split(";")[0] == plain["memory"]["detail"].split(";")[0]


def test_draft_model_compatible_and_missing(package, tiny_model_factory, tmp_path, capsys):
    draft = tiny_model_factory("llama", layers=1)
    argv = ["--model", str(package), "--listen", "127.0.0.1:0", "--http-port", "0"]
    argv += ["--spec-type", "draft-model"]
    code, checks = coordinator_doctor([*argv, "--draft-model", str(draft)], capsys)
    assert code == 0
    assert checks["draft model"]["status"] == "PASS"
    assert "tokenizer matches the target (49152 tokens)" in checks["draft model"]["detail"]
    # Stage 0 serves with the n-gram drafter when the draft cannot be used: a WARN.
    code, checks = coordinator_doctor([*argv, "--draft-model", str(tmp_path / "nope")], capsys)
    assert code == 0
    assert checks["draft model"]["status"] == "WARN"
    assert f"draft model path {tmp_path / 'nope'} does not exist" in checks["draft model"]["detail"]


def test_draft_model_without_a_draft_type_is_unused(package, tiny_model_factory, capsys):
    draft = tiny_model_factory("llama", layers=1)
    argv = ["--model", str(package), "--listen", "127.0.0.1:0", "--http-port", "0"]
    code, checks = coordinator_doctor([*argv, "--draft-model", str(draft)], capsys)
    assert code == 0
    assert checks["draft model"]["status"] == "WARN"
    assert "is not used: speculation type is 'suffix'" in checks["draft model"]["detail"]


# ---- mesh-stage doctor -------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_stage_coordinator_nobody_listens_on(tmp_path, capsys):
    port = closed_port()
    argv = ["--coordinator", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0"]
    code, checks = stage_doctor([*argv, "--cache-dir", str(tmp_path / "cache")], capsys)
    assert code == 1
    failure = only_failure(checks)
    assert failure["check"] == "coordinator"
    assert f"nothing listens at 127.0.0.1:{port} (connection refused)" in failure["detail"]
    assert checks["package"]["status"] == "WARN"
    assert checks["cache dir"]["status"] == "PASS"


def test_stage_data_port_in_use(tmp_path, capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        argv = ["--coordinator", f"127.0.0.1:{closed_port()}", "--listen", "127.0.0.1:0"]
        argv += ["--data-port", str(port), "--cache-dir", str(tmp_path / "cache")]
        _, checks = stage_doctor(argv, capsys)
        _, over_grpc = stage_doctor([*argv, "--data-transport", "grpc"], capsys)
    ports = [c for c in checks if c["check"] == "port"]
    assert [c["status"] for c in ports] == ["PASS", "FAIL"]
    assert f"--data-port 127.0.0.1:{port} is in use" in ports[1]["detail"]
    assert [c["status"] for c in over_grpc if c["check"] == "port"] == ["PASS"]


def test_stage_console_script_memory_beyond_the_device(tmp_path):
    argv = ["--coordinator", f"127.0.0.1:{closed_port()}", "--listen", "127.0.0.1:0"]
    result = subprocess.run(
        [BIN / "mesh-stage", "doctor", *argv, "--memory", "100TiB", "--cache-dir", tmp_path],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    memory = next(line for line in result.stdout.splitlines() if " memory " in line)
    assert memory.startswith("FAIL") and "--memory 102400.0 GiB is more than cpu has" in memory


def test_stage_cache_dir_not_writable(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = ["--coordinator", f"127.0.0.1:{closed_port()}", "--listen", "127.0.0.1:0"]
    code, checks = stage_doctor([*argv, "--cache-dir", str(blocker / "cache")], capsys)
    assert code == 1
    assert checks["cache dir"]["status"] == "FAIL"
    assert f"{blocker} is not a directory" in checks["cache dir"]["detail"]


def test_stage_bad_toml_key(tmp_path, capsys):
    config = tmp_path / "mesh.toml"
    config.write_text('[stage]\ncoordinater = "10.0.0.1:7070"\n')
    code, checks = stage_doctor(["--config", str(config)], capsys)
    assert code == 1
    assert "unknown key(s) coordinater in [stage]" in checks["config"]["detail"]


def test_stage_quantised_kernels(tmp_path, capsys, monkeypatch):
    """PASS with where the kernels were built; with no compiler, auto warns and
    native fails, each saying what to do."""
    from mesh.runtime import native

    monkeypatch.setenv("MESH_KERNEL_CACHE", str(tmp_path / "kernels"))
    argv = ["--coordinator", f"127.0.0.1:{closed_port()}", "--listen", "127.0.0.1:0"]
    argv += ["--cache-dir", str(tmp_path / "cache")]
    _, checks = stage_doctor(argv, capsys)
    kernels = checks["quantised kernels"]
    if native.library() is None:
        assert kernels["status"] == "WARN"
    else:
        assert kernels["status"] == "PASS" and str(tmp_path / "kernels") in kernels["detail"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("MESH_KERNEL_CACHE", str(tmp_path / "other"))
    _, checks = stage_doctor(argv, capsys)
    assert checks["quantised kernels"]["status"] == "WARN"
    assert "torch's kernels" in checks["quantised kernels"]["detail"]
    _, checks = stage_doctor([*argv, "--quantised-kernel", "native"], capsys)
    kernels = checks["quantised kernels"]
    assert kernels["status"] == "FAIL" and "install a C compiler" in kernels["fix"]
    _, checks = stage_doctor([*argv, "--quantised-kernel", "torch"], capsys)
    assert checks["quantised kernels"]["status"] == "PASS"


def test_a_listener_is_named_by_its_command_not_its_cut_comm(tmp_path) -> None:
    """/proc's comm is cut to 15 characters (``mesh-coordinato``): the listener of a
    port is named by its script and first argument."""
    import subprocess
    import sys
    import time

    from mesh.doctor.host import listener_of

    script = tmp_path / "mesh-coordinator-like"
    script.write_text(
        "import socket, sys, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "print(s.getsockname()[1], flush=True); time.sleep(60)\n"
    )
    argv = [sys.executable, str(script), "up"]
    holder = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        port = int(holder.stdout.readline())
        deadline = time.monotonic() + 10
        while (named := listener_of(port)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert named == f"pid {holder.pid} (mesh-coordinator-like up)"
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize(
    ("cmdline", "named"),
    [
        (["/v/bin/python", "-P", "-m", "stage.cli", "join", "--x"], "stage.cli join"),
        (["/v/bin/python3.11", "-m", "coordinator.cli", "up"], "coordinator.cli up"),
        (["/v/bin/python", "-u", "/v/bin/mesh-coordinator", "up"], "mesh-coordinator up"),
        (["/usr/sbin/nginx", "-g", "daemon off;"], "nginx"),
    ],
)
def test_a_port_holder_is_named_as_an_operator_knows_it(tmp_path, cmdline, named) -> None:
    """``up`` runs its local stages as ``python -P -m stage.cli join``: the holder of a
    port is named ``stage.cli join``, not by the interpreter's flags."""
    from mesh.doctor.host import _command_of

    (tmp_path / "comm").write_text("python\n")
    (tmp_path / "cmdline").write_bytes(b"\0".join(a.encode() for a in cmdline) + b"\0")
    assert _command_of(tmp_path) == named
