"""`mesh-stage join`: run a stage node that joins a coordinator and obeys it;
`mesh-stage doctor`: check this host's setup for it."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from mesh.codec import JoinRequest
from mesh.config import add_speculation_arguments
from mesh.discovery import find_coordinator, parse_auto, rediscover
from mesh.doctor import add_doctor_arguments
from mesh.errors import InvalidRequest, MeshError
from mesh.gcpause import GcPauses
from mesh.grpc_util import bind, new_server
from mesh.lifetime import watch_parent
from mesh.logsetup import configure_logging
from mesh.metrics import serve_metrics
from mesh.netaddr import advertise_host, split_host_port, url_host
from mesh.proto.v1 import data_pb2_grpc, stage_pb2_grpc
from mesh.security import (
    add_security_arguments,
    install,
    log_posture,
    security_from_args,
    security_settings,
    validate,
)
from mesh.settings import FrontendConfig, StageConfig, add_arguments, resolve
from mesh.settings.commands import JoinConfig, add_config_arguments, print_config, read_config
from stage.hardware import offered_memory
from stage.membership import Membership
from stage.node import NodeSettings, StageNode
from stage.package_client import CoordinatorPackageSource
from stage.servicers import (
    STAGE0_FORWARD_REFUSAL,
    STAGE_GRPC_WORKERS,
    ControlServicer,
    DataServicer,
)
from stage.tcp_data import TcpDataServer

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 20.0
# How long `--coordinator auto` looks for a coordinator before giving up (a service
# manager starts the stage again).
DISCOVERY_TIMEOUT_S = 120.0


def default_cache_dir() -> Path:
    home = Path(os.environ.get("MESH_HOME", Path.home() / ".cache" / "mesh"))
    return home / "slices"


def default_node_id(cache_dir: Path) -> str:
    """Stable per host and cache directory: a stage restarted the same way rejoins
    under the same id (and the coordinator puts it back in its place)."""
    digest = hashlib.sha256(str(cache_dir.resolve()).encode()).hexdigest()[:6]
    return f"{socket.gethostname()}-{digest}"


def found_coordinator(stage: StageConfig, token: str | None) -> StageConfig:
    """``stage`` with ``--coordinator auto`` replaced by the address of the coordinator
    that answered on this host's networks (mesh/discovery.py)."""
    port = parse_auto(stage.coordinator)
    if port is None:
        return stage
    offer = find_coordinator(port, token, DISCOVERY_TIMEOUT_S)
    logger.info(
        "found the coordinator at %s (serving %s) on this network", offer.address, offer.model_id
    )
    return dataclasses.replace(stage, coordinator=offer.address)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mesh-stage", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    join = sub.add_parser("join", help="join a coordinator and serve a layer range")
    add_stage_arguments(join)
    doctor = sub.add_parser("doctor", help="check this host's setup for `join` (takes its flags)")
    add_stage_arguments(doctor)
    add_doctor_arguments(doctor)
    return parser


def add_stage_arguments(join: argparse.ArgumentParser) -> None:
    """``join``'s flags: the [stage] section, the [frontend] section (with
    ``--frontend``), speculation and security."""
    add_config_arguments(join)
    add_arguments(join, StageConfig)
    add_arguments(join.add_argument_group("stage 0 (with --frontend)"), FrontendConfig)
    add_speculation_arguments(join)
    add_security_arguments(join)


def resolve_join(args: argparse.Namespace) -> JoinConfig:
    """Resolve ``join``'s configuration once (CLI > environment > TOML > built-in);
    errors name the key and its source."""
    toml, source = read_config(args)
    return JoinConfig(
        stage=resolve(StageConfig, "stage", args, toml, toml_source=source),
        frontend=resolve(FrontendConfig, "frontend", args, toml, toml_source=source),
        toml=toml,
    )


def run(args: argparse.Namespace) -> int:
    config = resolve_join(args)
    if args.print_config:
        print_config([config.stage, config.frontend], security_settings(args))
        return 0
    stage = config.stage.value
    from mesh.runtime import invariant, linear, qkernels
    from mesh.runtime.skeleton import resolve_device

    # A device this host lacks fails now, not at the first load the coordinator plans.
    resolve_device(stage.device)

    qkernels.MODE = stage.quantised_kernel
    if stage.quantised_gemm and stage.quantised_kernel == "auto":
        # The GEMM path belongs to torch's kernels; asking for it picks them.
        qkernels.MODE = "torch"
    if stage.quantised_gemm:
        linear.QUANTISED_GEMM = True
        if stage.row_invariant == "on":
            logger.warning("--quantised-gemm turns row-invariant arithmetic off")
    invariant.MODE = "off" if stage.quantised_gemm else stage.row_invariant
    if stage.threads > 0:
        import torch

        torch.set_num_threads(stage.threads)
    cache_dir = stage.cache_dir or default_cache_dir()
    node_id = stage.node_id or default_node_id(cache_dir)
    configure_logging(stage.log_level, prefix=node_id)
    offered = offered_memory(stage.device, stage.memory, stage.memory_margin)
    logger.info(
        "offering %s bytes of memory (%s)", offered.bytes_total, offered.detail or "unknown"
    )
    security = validate(security_from_args(args), serving=True)
    install(security)
    log_posture(security, f"stage {node_id}")
    auto_port = parse_auto(stage.coordinator)
    stage = found_coordinator(stage, security.join_token)
    server = new_server(STAGE_GRPC_WORKERS)
    port = bind(server, stage.listen)
    host = advertise_host(split_host_port(stage.listen)[0], stage.advertise, stage.coordinator)
    address = f"{url_host(host)}:{port}"
    if security.tls_cert is not None:
        # Peers dial the advertised address and check that the certificate names it:
        # one that does not would join and never be reached (found late, and read
        # as an unreachable address).
        from mesh.doctor.tls import certificate_problem

        problem = certificate_problem(security, ((host, "advertised"),))
        if problem is not None:
            raise InvalidRequest(problem)
    node = StageNode(
        NodeSettings(
            node_id=node_id,
            cache_dir=cache_dir,
            device=stage.device,
            inject_delay_ms=stage.inject_delay_ms,
            compile=stage.compile,
            cuda_graphs=stage.cuda_graphs,
            inline_frames=stage.inline_frames,
            prefix_cache_bytes=int(stage.prefix_cache_mb * 2**20),
            stuck_exit_after_s=stage.stuck_exit_after,
            gc_freeze=stage.gc_freeze,
        ),
        address,
        remote=(package_source := CoordinatorPackageSource(stage.coordinator, node_id)),
    )
    GcPauses(node.metrics.registry).install()
    metrics_host = split_host_port(stage.listen)[0]
    serve_metrics(node.metrics.registry, metrics_host, stage.metrics_port, who=f"stage {node_id}")
    stage_pb2_grpc.add_StageControlServicer_to_server(ControlServicer(node), server)
    data = DataServicer(node, node.deliver_result)
    if stage.frontend:  # the frontend's node is always stage 0 (coordinator/planner.py)
        data.forward_refusal = STAGE0_FORWARD_REFUSAL
    data_pb2_grpc.add_StageDataServicer_to_server(data, server)
    tcp = None
    if stage.data_transport == "tcp":
        listen_host = split_host_port(stage.listen)[0]
        tcp = TcpDataServer(
            listen_host,
            stage.data_port,
            data.frame_bytes,
            data.result_bytes,
            max_message_bytes=data.max_message_bytes,
            forward_refusal=data.forward_refusal,
        )
        data.tcp_endpoint, data.tcp_tls = f"{url_host(host)}:{tcp.port}", tcp.tls
        data.tcp = tcp
        tcp.start()
        logger.info("stage %s takes frames over framed TCP at %s", node_id, data.tcp_endpoint)
    server.start()
    logger.info("stage %s serving gRPC at %s", node_id, address)
    http_url = ""
    frontend = None
    if stage.frontend:
        from stage.frontend.host import start_frontend

        frontend = start_frontend(node, config, args, host)
        http_url = frontend.url
    membership = Membership(
        stage.coordinator,
        lambda: JoinRequest(
            node_id=node_id,
            address=address,
            device=stage.device,
            memory_bytes=offered.bytes_total,
            memory_source=offered.source,
            speed_hint=stage.speed,
            frontend=stage.frontend,
            http_url=http_url,
            term=node.term,
        ),
        node.heartbeat,
        on_term=node.observe_coordinator_term,
        # Found by discovery: found again if it comes back elsewhere.
        relocate=(
            None
            if auto_port is None
            else functools.partial(rediscover, auto_port, security.join_token)
        ),
        on_moved=lambda moved: setattr(package_source, "coordinator", moved),
        # Another process joined with this node id: serve nothing more.
        on_superseded=lambda taken_by: node.release(
            node.term, f"node id {node_id} was taken by the process at {taken_by}"
        ),
    )
    node.on_newer_term(membership.poke)
    node.coordinator_outage = membership.outage_s
    membership.start()
    stopped = threading.Event()
    # A second signal while draining stops without waiting for the running requests.
    hurry = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        if stopped.is_set():
            logger.warning("signal %s again: stopping without waiting for running requests", signum)
            hurry.set()
            return
        logger.info("signal %s: stopping", signum)
        stopped.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    watch_parent(stopped.set)
    stopped.wait()
    if frontend is not None:
        drain_s = config.frontend.value.drain_timeout
        logger.info(
            "draining: no new requests; up to %.0f s for the running ones (signal again: stop now)",
            drain_s,
        )
        frontend.drain(drain_s, hurry)
    # Whatever happens while shutting down, the process ends.
    deadline = threading.Timer(SHUTDOWN_GRACE_S, lambda: os._exit(1))
    deadline.daemon = True
    deadline.start()
    membership.stop()
    if frontend is not None:
        frontend.stop()
    node.stop()
    if tcp is not None:
        tcp.close()
    server.stop(grace=1.0).wait()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "doctor":
            from stage.doctor import run_doctor

            return run_doctor(args)
        return run(args)
    except MeshError as error:
        sys.stderr.write(f"mesh-stage: {error.message}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
