"""Security of a real mesh on 127.0.0.1: the join token, TLS (server and mutual) and
the HTTP API key, with the coordinator and stages as separate processes."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import pytest
from openai import OpenAI

from coordinator.certs import ClusterCertificates, generate_cluster_certs
from coordinator.cli import main as coordinator_main
from coordinator.localmesh import MeshProcesses, wait_for
from mesh.codec import (
    ClaimRequest,
    Frame,
    HeartbeatRequest,
    JoinRequest,
    Segment,
    SegmentKind,
    StatusReply,
    StatusRequest,
    frame_to_proto,
)
from mesh.grpc_util import channel
from mesh.proto.v1 import coordinator_pb2_grpc, data_pb2_grpc, stage_pb2_grpc
from mesh.security import REFUSED_MESSAGE, TOKEN_ENV, MeshSecurity

pytestmark = pytest.mark.slow

TOKEN = "mesh-test-token-7f3a9c2e41d8b5a6"
API_KEY = "sk-mesh-test-key-0e9b"
PROMPT = [1, 517, 2049, 33, 1200, 77, 4051, 9, 300]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[ClusterCertificates, Path, Path]:
    """This mesh's CA and one certificate for 127.0.0.1, another CA, the token file."""
    root = tmp_path_factory.mktemp("pki")
    made = generate_cluster_certs(root / "mesh", ("127.0.0.1",), shared=True)
    other = generate_cluster_certs(root / "other", ("127.0.0.1",), shared=True)
    token_file = root / "join-token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    return made, other.ca_cert, token_file


def tls_argv(made: ClusterCertificates, mutual: bool) -> tuple[str, ...]:
    node = made.nodes[0]
    argv = ("--tls-cert", str(node.cert), "--tls-key", str(node.key), "--tls-ca", str(made.ca_cert))
    return (*argv, "--tls-mutual") if mutual else argv


def trusted(made: ClusterCertificates, **overrides) -> MeshSecurity:
    """A client with this mesh's CA, certificate and token, unless overridden."""
    node = made.nodes[0]
    fields = dict(
        join_token=TOKEN,
        tls_cert=node.cert,
        tls_key=node.key,
        tls_ca=made.ca_cert,
        tls_mutual=True,
    )
    fields.update(overrides)
    return MeshSecurity(**fields)


def coordinator_status(address: str, settings: MeshSecurity) -> StatusReply:
    ch = channel(address, settings)
    try:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        return StatusReply.from_proto(stub.Status(StatusRequest().to_proto(), timeout=10))
    finally:
        ch.close()


def status_code(address: str, settings: MeshSecurity) -> grpc.StatusCode:
    try:
        coordinator_status(address, settings)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def listening_address(mesh: MeshProcesses) -> str:
    def found() -> str:
        if mesh.coordinator.poll() is not None:
            raise RuntimeError("coordinator exited:\n" + mesh.coordinator_log())
        for line in mesh.coordinator_log().splitlines():
            if " listening on " in line:
                return line.rsplit(" ", 1)[-1].strip()
        return ""

    return wait_for(found, 60, "the coordinator to listen")


# ---- server TLS, and the settings that `up` hands to the stages it spawns -------------


def test_server_tls_and_spawned_stage_inherit_token_and_tls(
    tmp_path: Path, tiny_package_factory, pki, capsys
) -> None:
    made, other_ca, token_file = pki
    package = tiny_package_factory("llama", layers=4)
    mesh = MeshProcesses(
        package,
        tmp_path / "coordinator-only",
        2,
        coordinator_args=(
            "--spawn-stages",
            "1",
            "--join-token-file",
            str(token_file),
            *tls_argv(made, mutual=False),
        ),
    )
    try:
        address = listening_address(mesh)
        client = trusted(made, tls_cert=None, tls_key=None, tls_mutual=False)

        # The spawned stage joined: it got the TLS flags and the token (in its env).
        def joined() -> StatusReply | None:
            reply = coordinator_status(address, client)
            return reply if any(s.node_id == "local-1" for s in reply.stages) else None

        reply = wait_for(joined, 60, "the spawned stage to join over TLS with the token")
        assert reply.stages[0].health == "alive"
        # Server-only TLS: a client with just the CA (and the token) is served ...
        assert status_code(address, client) == grpc.StatusCode.OK
        # ... a plaintext client or one that trusts another CA cannot connect ...
        plaintext = MeshSecurity(join_token=TOKEN)
        assert status_code(address, plaintext) == grpc.StatusCode.UNAVAILABLE
        foreign = MeshSecurity(join_token=TOKEN, tls_ca=other_ca)
        assert status_code(address, foreign) == grpc.StatusCode.UNAVAILABLE
        # ... and `mesh-coordinator status` takes the same flags.
        argv = ["status", "--coordinator", address, "--tls-ca", str(made.ca_cert)]
        assert coordinator_main([*argv, "--join-token-file", str(token_file)]) == 0
        assert "local-1" in capsys.readouterr().out
        assert coordinator_main(argv) == 2
        assert REFUSED_MESSAGE in capsys.readouterr().err
    finally:
        mesh.close()
    assert TOKEN not in mesh.coordinator_log()


# ---- a mesh with the token, mutual TLS and an API key ----------------------------------


@pytest.fixture(scope="module")
def secure_mesh(tmp_path_factory: pytest.TempPathFactory, tiny_package_factory, pki):
    made, _, token_file = pki
    package = tiny_package_factory("llama", layers=4)
    tls = tls_argv(made, mutual=True)
    mesh = MeshProcesses(
        package,
        tmp_path_factory.mktemp("secure-mesh"),
        2,
        # The coordinator reads the token from a file, the stages from the environment.
        coordinator_args=("--join-token-file", str(token_file), *tls),
        stage_args=tls,
        env={TOKEN_ENV: TOKEN, "MESH_API_KEY": API_KEY},
        security=trusted(made),
    )
    try:
        mesh.start()
        mesh.wait_serving()
        yield mesh
    finally:
        mesh.close()


def test_coordinator_refuses_calls_without_the_token(secure_mesh, pki) -> None:
    made = pki[0]
    address = secure_mesh.coordinator_address
    for settings in (trusted(made, join_token=None), trusted(made, join_token=TOKEN[:-1] + "x")):
        ch = channel(address, settings)
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        calls = (
            lambda stub=stub: stub.Join(
                JoinRequest("intruder", "127.0.0.1:1", "cpu", 1 << 40, 100.0).to_proto(),
                timeout=10,
            ),
            lambda stub=stub: stub.Heartbeat(
                HeartbeatRequest("stage-1", 0, "idle", 0).to_proto(), timeout=10
            ),
            lambda stub=stub: stub.Status(StatusRequest().to_proto(), timeout=10),
        )
        for call in calls:
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert refused.value.details() == REFUSED_MESSAGE
        ch.close()
    status = secure_mesh.status()
    assert sorted(s.node_id for s in status.stages) == ["stage-0", "stage-1"]
    assert status.state == "serving"
    assert "refused /mesh.v1.Coordinator/" in secure_mesh.coordinator_log()


def test_stages_refuse_control_and_data_calls_without_the_token(secure_mesh, pki) -> None:
    made = pki[0]
    status = secure_mesh.status()
    stage0 = next(s for s in status.stages if s.stage_index == 0)
    stage1 = next(s for s in status.stages if s.stage_index == 1)
    segment = Segment("intruder", "intruder", SegmentKind.PREFILL, 0, (1, 2, 3))
    frame = Frame(status.term, 1, (segment,))
    wrong = trusted(made, join_token="not-the-mesh-token")
    ch = channel(stage1.address, wrong)
    data = data_pb2_grpc.StageDataStub(ch)
    with pytest.raises(grpc.RpcError) as forward:
        list(data.Forward(iter([frame_to_proto(frame)]), timeout=10))
    assert forward.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert forward.value.details() == REFUSED_MESSAGE
    control = stage_pb2_grpc.StageControlStub(ch)
    with pytest.raises(grpc.RpcError) as claim:
        control.Claim(ClaimRequest(status.term + 1, "intruder", "m").to_proto(), timeout=10)
    assert claim.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ch.close()
    # The Return stream into stage 0 is guarded too.
    ch = channel(stage0.address, trusted(made, join_token=None))
    with pytest.raises(grpc.RpcError) as returned:
        data_pb2_grpc.StageDataStub(ch).Return(iter(()), timeout=10)
    assert returned.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ch.close()
    # The intruder's Claim did not fence the pipeline.
    assert secure_mesh.status().term == status.term


def test_tls_refuses_plaintext_and_clients_without_a_certificate(secure_mesh, pki) -> None:
    made, other_ca, _ = pki
    stage1 = next(s for s in secure_mesh.status().stages if s.stage_index == 1)
    clients = {
        "plaintext": MeshSecurity(join_token=TOKEN),
        "CA but no certificate": trusted(made, tls_cert=None, tls_key=None, tls_mutual=False),
        "certificate from another CA": trusted(made, tls_ca=other_ca),
    }
    for what, settings in clients.items():
        code = status_code(secure_mesh.coordinator_address, settings)
        assert code == grpc.StatusCode.UNAVAILABLE, what
        ch = channel(stage1.address, settings)
        with pytest.raises(grpc.RpcError) as refused:
            stage_pb2_grpc.StageControlStub(ch).Claim(
                ClaimRequest(0, "x", "m").to_proto(), timeout=10
            )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, what
        ch.close()


def test_http_api_key_and_a_completion_through_the_secured_mesh(secure_mesh) -> None:
    url = secure_mesh.http_url
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    anonymous = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["type"] == "authentication_error"
    wrong = httpx.post(
        f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"}, timeout=30
    )
    assert wrong.status_code == 401
    keyed = httpx.post(
        f"{url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert keyed.status_code == 200
    assert keyed.json()["usage"]["completion_tokens"] == 4
    # The OpenAI client, through both stages over mutual TLS with the token.
    client = OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    chat = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=6,
        temperature=0,
    )
    assert chat.usage.completion_tokens > 0
    assert chat.choices[0].message.content is not None


def test_the_token_shows_in_no_command_line_or_log(secure_mesh) -> None:
    processes = [secure_mesh.coordinator, *secure_mesh.stages.values()]
    assert len(processes) == 3
    for process in processes:
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().replace(b"\0", b" ")
        assert TOKEN.encode() not in cmdline
    logs = [secure_mesh.coordinator_log()] + [
        secure_mesh.stage_log(node_id) for node_id in secure_mesh.stages
    ]
    for log in logs:
        assert TOKEN not in log
        assert "the mesh is unauthenticated" not in log
