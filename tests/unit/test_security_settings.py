"""Join token resolution, the server/client interceptors and TLS on real in-process
gRPC servers bound to 127.0.0.1."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from coordinator.certs import generate_cluster_certs
from mesh import security as sec
from mesh.errors import InvalidRequest
from mesh.grpc_util import bind, channel, new_server
from mesh.security import (
    REFUSED_MESSAGE,
    TOKEN_ENV,
    MeshSecurity,
    add_security_arguments,
    log_posture,
    security_from_args,
    validate,
)

TOKEN = "s3cret-token-0123456789abcdef"
SERVICE = "meshtest.Echo"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, default=None)
    add_security_arguments(parser)
    return parser.parse_args(argv)


# ---- resolution ----------------------------------------------------------------------


def test_token_file_wins_over_env_and_env_over_toml(tmp_path: Path) -> None:
    (tmp_path / "flag-token").write_text("from-file\n")
    (tmp_path / "toml-token").write_text("from-toml")
    config = tmp_path / "mesh.toml"
    config.write_text('[security]\njoin_token_file = "toml-token"\ntls_ca = "ca.pem"\n')
    env = {TOKEN_ENV: "from-env"}
    flagged = security_from_args(
        parse(["--config", str(config), "--join-token-file", str(tmp_path / "flag-token")]), env
    )
    assert flagged.join_token == "from-file"
    assert security_from_args(parse(["--config", str(config)]), env).join_token == "from-env"
    from_toml = security_from_args(parse(["--config", str(config)]), {})
    assert from_toml.join_token == "from-toml"
    # Relative paths in the TOML are relative to the TOML file.
    assert from_toml.tls_ca == tmp_path / "ca.pem"
    assert security_from_args(parse([]), {}).join_token is None


def test_bad_tokens_and_config_are_refused_with_clear_messages(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(InvalidRequest, match="is empty"):
        security_from_args(parse(["--join-token-file", str(empty)]), {})
    with pytest.raises(InvalidRequest, match="cannot read the join token file"):
        security_from_args(parse(["--join-token-file", str(tmp_path / "missing")]), {})
    with pytest.raises(InvalidRequest, match="printable ASCII"):
        security_from_args(parse([]), {TOKEN_ENV: "tök\u00e9n"})
    config = tmp_path / "mesh.toml"
    config.write_text('[security]\njoin_token = "inline"\n')
    with pytest.raises(InvalidRequest, match="unknown key.*join_token.*belongs in a file"):
        security_from_args(parse(["--config", str(config)]), {})


def test_flags_override_toml_and_mutual_can_be_switched_off(tmp_path: Path) -> None:
    config = tmp_path / "mesh.toml"
    config.write_text('[security]\ntls_mutual = true\ntls_cert = "/etc/a.pem"\n')
    args = parse(["--config", str(config), "--no-tls-mutual", "--tls-cert", "/x/b.pem"])
    resolved = security_from_args(args, {})
    assert resolved.tls_mutual is False
    assert resolved.tls_cert == Path("/x/b.pem")


def test_validate_checks_that_tls_settings_fit_together(tmp_path: Path) -> None:
    made = generate_cluster_certs(tmp_path / "pki", ("127.0.0.1",))
    node = made.nodes[0]
    with pytest.raises(InvalidRequest, match="go together"):
        validate(MeshSecurity(tls_cert=node.cert), serving=False)
    with pytest.raises(InvalidRequest, match="mutual TLS needs --tls-ca"):
        validate(MeshSecurity(tls_cert=node.cert, tls_key=node.key, tls_mutual=True), False)
    with pytest.raises(InvalidRequest, match="needs --tls-cert and --tls-key"):
        validate(MeshSecurity(tls_ca=made.ca_cert), serving=True)
    # A pure client (mesh-coordinator status) needs only the CA.
    validate(MeshSecurity(tls_ca=made.ca_cert), serving=False)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(InvalidRequest, match="is not PEM"):
        validate(MeshSecurity(tls_ca=junk), serving=False)
    with pytest.raises(InvalidRequest, match="cannot read TLS file"):
        validate(MeshSecurity(tls_ca=tmp_path / "nope.pem"), serving=False)


def test_spawned_stages_get_the_token_in_env_never_in_argv(tmp_path: Path) -> None:
    settings = MeshSecurity(
        join_token=TOKEN, tls_cert=Path("c.pem"), tls_key=Path("k.pem"), tls_ca=Path("ca.pem")
    )
    argv = settings.child_argv()
    assert TOKEN not in " ".join(argv)
    assert argv[argv.index("--tls-ca") + 1] == str(Path("ca.pem").absolute())
    assert "--tls-mutual" not in argv
    assert settings.child_env({"PATH": "/bin"}) == {"PATH": "/bin", TOKEN_ENV: TOKEN}
    assert TOKEN not in repr(settings) and TOKEN not in settings.describe()
    assert MeshSecurity().child_env({}) == {}


def test_open_mesh_warns_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(sec, "_posture_logged", False)
    with caplog.at_level(logging.WARNING, logger="mesh.security"):
        log_posture(MeshSecurity(), "the coordinator")
        log_posture(MeshSecurity(), "the coordinator")
    warnings = [r for r in caplog.records if "unauthenticated" in r.getMessage()]
    assert len(warnings) == 1
    assert TOKEN_ENV in warnings[0].getMessage()


# ---- the interceptor on a real server ------------------------------------------------


class EchoServer:
    """A server with one method of each streaming kind, counting the calls that reach
    the handlers."""

    def __init__(self, settings: MeshSecurity | None) -> None:
        self.calls = 0
        self.server = new_server(4, settings)

        def unary(request: bytes, context) -> bytes:
            self.calls += 1
            return request

        def stream(requests: Iterator[bytes], context) -> Iterator[bytes]:
            self.calls += 1
            yield from requests

        handlers = {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.stream_stream_rpc_method_handler(stream),
            "Fan": grpc.unary_stream_rpc_method_handler(lambda r, c: iter([r, r])),
            "Sum": grpc.stream_unary_rpc_method_handler(lambda rs, c: b"".join(rs)),
        }
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),)
        )
        self.port = bind(self.server, "127.0.0.1:0", settings)
        self.server.start()
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(None)


def call_all(address: str, settings: MeshSecurity) -> list[bytes]:
    ch = channel(address, settings)
    try:
        unary = ch.unary_unary(f"/{SERVICE}/Unary")(b"a", timeout=5)
        stream = list(ch.stream_stream(f"/{SERVICE}/Stream")(iter([b"b", b"c"]), timeout=5))
        fan = list(ch.unary_stream(f"/{SERVICE}/Fan")(b"d", timeout=5))
        total = ch.stream_unary(f"/{SERVICE}/Sum")(iter([b"e", b"f"]), timeout=5)
        return [unary, *stream, *fan, total]
    finally:
        ch.close()


@pytest.fixture
def echo_factory():
    servers: list[EchoServer] = []

    def make(settings: MeshSecurity | None) -> EchoServer:
        servers.append(EchoServer(settings))
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


def test_token_required_for_every_call_kind(echo_factory) -> None:
    server = echo_factory(MeshSecurity(join_token=TOKEN))
    assert call_all(server.address, MeshSecurity(join_token=TOKEN)) == [
        b"a",
        b"b",
        b"c",
        b"d",
        b"d",
        b"ef",
    ]
    assert server.calls == 2
    for wrong in (MeshSecurity(), MeshSecurity(join_token=TOKEN + "x")):
        ch = channel(server.address, wrong)
        kinds = [
            lambda ch=ch: ch.unary_unary(f"/{SERVICE}/Unary")(b"a", timeout=5),
            lambda ch=ch: list(ch.stream_stream(f"/{SERVICE}/Stream")(iter([b"b"]), timeout=5)),
            lambda ch=ch: list(ch.unary_stream(f"/{SERVICE}/Fan")(b"d", timeout=5)),
            lambda ch=ch: ch.stream_unary(f"/{SERVICE}/Sum")(iter([b"e"]), timeout=5),
        ]
        for call in kinds:
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert refused.value.details() == REFUSED_MESSAGE
        ch.close()
    assert server.calls == 2  # refused calls never reached a handler


def test_open_server_accepts_any_client(echo_factory) -> None:
    server = echo_factory(MeshSecurity())
    assert call_all(server.address, MeshSecurity(join_token=TOKEN))[0] == b"a"
    assert call_all(server.address, MeshSecurity())[0] == b"a"


def test_channel_and_server_default_to_the_installed_settings(monkeypatch, echo_factory) -> None:
    monkeypatch.setattr(sec, "_active", MeshSecurity(join_token=TOKEN))
    server = echo_factory(None)  # the installed settings: the token is required
    assert unary_code(server.address, MeshSecurity()) == grpc.StatusCode.UNAUTHENTICATED
    ch = channel(server.address)  # the installed settings: the token is sent
    try:
        assert ch.unary_unary(f"/{SERVICE}/Unary")(b"z", timeout=5) == b"z"
    finally:
        ch.close()


# ---- TLS -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("pki")
    return (
        generate_cluster_certs(root / "mesh", ("127.0.0.1", "localhost")),
        generate_cluster_certs(root / "other", ("127.0.0.1",)),
    )


def tls(made, index: int = 0, mutual: bool = False, **overrides) -> MeshSecurity:
    node = made.nodes[index]
    fields = dict(tls_cert=node.cert, tls_key=node.key, tls_ca=made.ca_cert, tls_mutual=mutual)
    fields.update(overrides)
    return MeshSecurity(**fields)


def unary_code(address: str, settings: MeshSecurity) -> grpc.StatusCode:
    ch = channel(address, settings)
    try:
        ch.unary_unary(f"/{SERVICE}/Unary")(b"a", timeout=5)
        return grpc.StatusCode.OK
    except grpc.RpcError as error:
        return error.code()
    finally:
        ch.close()


def test_tls_server_refuses_plaintext_and_untrusted_clients(echo_factory, pki) -> None:
    mesh_ca, other_ca = pki
    server = echo_factory(tls(mesh_ca))
    assert unary_code(server.address, MeshSecurity()) == grpc.StatusCode.UNAVAILABLE
    assert unary_code(server.address, MeshSecurity(tls_ca=mesh_ca.ca_cert)) == grpc.StatusCode.OK
    # A client that trusts another CA does not accept this server's certificate.
    assert (
        unary_code(server.address, MeshSecurity(tls_ca=other_ca.ca_cert))
        == grpc.StatusCode.UNAVAILABLE
    )
    # The certificate's names are checked: this one is for 127.0.0.1, not "localhost".
    by_name = MeshSecurity(tls_ca=mesh_ca.ca_cert)
    assert unary_code(f"localhost:{server.port}", by_name) == grpc.StatusCode.UNAVAILABLE
    named = echo_factory(tls(mesh_ca, index=1))
    assert unary_code(f"localhost:{named.port}", by_name) == grpc.StatusCode.OK


def test_mutual_tls_requires_a_client_certificate_from_the_ca(echo_factory, pki) -> None:
    mesh_ca, other_ca = pki
    server = echo_factory(tls(mesh_ca, mutual=True, join_token=TOKEN))
    no_cert = MeshSecurity(tls_ca=mesh_ca.ca_cert, join_token=TOKEN)
    assert unary_code(server.address, no_cert) == grpc.StatusCode.UNAVAILABLE
    foreign = tls(other_ca, tls_ca=mesh_ca.ca_cert, join_token=TOKEN)
    assert unary_code(server.address, foreign) == grpc.StatusCode.UNAVAILABLE
    assert unary_code(server.address, tls(mesh_ca, join_token=TOKEN)) == grpc.StatusCode.OK
    # TLS does not replace the token: a trusted client without it is still refused.
    assert unary_code(server.address, tls(mesh_ca)) == grpc.StatusCode.UNAUTHENTICATED
