"""Addresses and ports an operator gets wrong are refused at start with what is
wrong: a gRPC port another process serves (gRPC would share it through
SO_REUSEPORT), ports past 65535 (a socket would wrap them), hosts that do not resolve
or are not this host's, a TLS key that is not the certificate's or a certificate
another CA signed."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.certs import generate_cluster_certs
from mesh.errors import InvalidRequest, Unavailable
from mesh.grpc_util import bind, new_server
from mesh.netaddr import coordinator_setting, host_port_setting, split_host_port
from mesh.security import MeshSecurity, validate

OPEN = MeshSecurity()


def test_a_served_grpc_port_is_not_bound_twice() -> None:
    first = new_server(1, OPEN)
    port = bind(first, "127.0.0.1:0", OPEN)
    first.start()
    try:
        with pytest.raises(Unavailable, match=f"port {port} is in use by another process"):
            bind(new_server(1, OPEN), f"127.0.0.1:{port}", OPEN)
    finally:
        first.stop(None)


@pytest.mark.parametrize(
    ("listen", "says"),
    [
        ("no.such.host.invalid:17002", "does not resolve"),
        ("192.0.2.77:17005", "not an address of this host"),
    ],
)
def test_bind_failures_say_why(listen: str, says: str) -> None:
    with pytest.raises(Unavailable, match=says):
        bind(new_server(1, OPEN), listen, OPEN)


def test_ports_past_65535_and_addresses_without_ports_are_refused() -> None:
    with pytest.raises(ValueError, match="out of range"):
        split_host_port("127.0.0.1:70000")
    listen, dial = host_port_setting(any_port=True), host_port_setting(any_port=False)
    assert listen("0.0.0.0:0") == "0.0.0.0:0" and dial("[::1]:7070") == "[::1]:7070"
    for bad in ("127.0.0.1", "127.0.0.1:70000", "127.0.0.1:-5", ":7070", ""):
        with pytest.raises(InvalidRequest, match="HOST:PORT|out of range"):
            dial(bad)
    with pytest.raises(InvalidRequest, match="port 0"):
        dial("127.0.0.1:0")
    assert coordinator_setting("auto") == "auto" and coordinator_setting("auto:7070")
    with pytest.raises(InvalidRequest):
        coordinator_setting("127.0.0.1")


def test_a_key_or_ca_that_does_not_belong_to_the_certificate_is_refused(tmp_path: Path) -> None:
    made = generate_cluster_certs(tmp_path / "a", ("127.0.0.1",), shared=True)
    other = generate_cluster_certs(tmp_path / "b", ("127.0.0.1",), shared=True)
    node, stranger = made.nodes[0], other.nodes[0]
    good = MeshSecurity(tls_cert=node.cert, tls_key=node.key, tls_ca=made.ca_cert)
    assert validate(good, serving=True) is good
    with pytest.raises(InvalidRequest, match="is not the key of"):
        validate(MeshSecurity(tls_cert=node.cert, tls_key=stranger.key), serving=True)
    with pytest.raises(InvalidRequest, match="not signed by the CA"):
        validate(MeshSecurity(tls_cert=node.cert, tls_key=node.key, tls_ca=other.ca_cert), True)
    # A client that serves nothing is not held to a certificate of its own.
    assert validate(MeshSecurity(tls_ca=made.ca_cert), serving=False)


def test_certs_refuses_a_ca_key_that_is_not_the_ca_s(tmp_path: Path) -> None:
    generate_cluster_certs(tmp_path / "a", ("127.0.0.1",), shared=True)
    other = generate_cluster_certs(tmp_path / "b", ("127.0.0.1",), shared=True)
    (tmp_path / "a" / other.ca_key.name).write_bytes(other.ca_key.read_bytes())
    with pytest.raises(InvalidRequest, match="is not the key of"):
        generate_cluster_certs(tmp_path / "a", ("10.0.0.8",), shared=True)
    (tmp_path / "a" / other.ca_key.name).write_text("garbage")
    with pytest.raises(InvalidRequest, match="cannot be read"):
        generate_cluster_certs(tmp_path / "a", ("10.0.0.8",), shared=True)


def test_a_short_or_shared_join_token_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import mesh.security as security
    from mesh.doctor.tls import check_security

    token_file = tmp_path / "token"
    token_file.write_text("short\n")
    token_file.chmod(0o644)
    with caplog.at_level("WARNING"):
        assert security.read_token_file(token_file) == "short"
    assert "can be read by other users" in caplog.text
    (token,) = [
        r for r in check_security(MeshSecurity(join_token="short"), ()) if r.check == "join token"
    ]
    assert token.status == "WARN" and "5 characters" in token.detail
    strong = MeshSecurity(join_token="a-random-secret-0123456789abcdef")
    assert [r.status for r in check_security(strong, ()) if r.check == "join token"] == ["PASS"]


def test_an_unknown_log_level_from_the_environment_is_said(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import logging

    from mesh.logsetup import configure_logging

    root = logging.getLogger()
    kept = root.handlers[:]
    root.handlers.clear()
    try:
        monkeypatch.setenv("MESH_LOG_LEVEL", "bogus")
        configure_logging()
        assert root.level == logging.INFO
    finally:
        root.handlers[:] = kept
    assert "log level 'BOGUS' is not one of" in capsys.readouterr().err


def test_a_stage_whose_certificate_does_not_name_its_advertised_address_is_refused(
    tmp_path: Path,
) -> None:
    """Peers dial a stage at its advertised address and check that its certificate
    names it: `join` refuses to start with one that does not (before, the stage
    joined, was never reached, and the coordinator blamed an unreachable address)."""
    import subprocess
    import sys

    made = generate_cluster_certs(tmp_path / "pki", ("10.88.0.2",), shared=True)
    node = made.nodes[0]
    argv = [sys.executable, "-m", "stage.cli", "join", "--coordinator", "127.0.0.1:1"]
    argv += ["--listen", "127.0.0.1:0", "--advertise", "127.0.0.1", "--device", "cpu"]
    argv += ["--tls-cert", str(node.cert), "--tls-key", str(node.key)]
    argv += ["--tls-ca", str(made.ca_cert), "--cache-dir", str(tmp_path / "cache")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "names 10.88.0.2, not 127.0.0.1 (advertised)" in done.stderr, done.stderr


def test_an_unreachable_peer_is_explained_by_what_the_network_said() -> None:
    """A routing failure is not a TLS question: the hint names what the network said,
    and only an unexplained failure points at TLS settings."""
    from mesh.security import unavailable_hint

    routed = unavailable_hint(OPEN, "failed to connect: No route to host")
    assert "route" in routed and "TLS" not in routed
    assert "nothing listens" in unavailable_hint(OPEN, "connect: Connection refused (111)")
    assert "TLS" in unavailable_hint(OPEN, "Socket closed")
