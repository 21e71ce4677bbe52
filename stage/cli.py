"""`mesh-stage join`: run a stage node that joins a coordinator and obeys it."""

from __future__ import annotations

import argparse
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
from mesh.errors import InvalidRequest, MeshError
from mesh.grpc_util import bind, new_server
from mesh.lifetime import watch_parent
from mesh.logsetup import configure_logging
from mesh.netaddr import advertise_host, split_host_port, url_host
from mesh.proto.v1 import data_pb2_grpc, stage_pb2_grpc
from mesh.security import add_security_arguments, install, log_posture, security_from_args, validate
from mesh.types import DEFAULT_PREFIX_BYTES, DEFAULT_PREFIX_TOKENS
from mesh.units import parse_bytes
from stage.membership import Membership
from stage.node import NodeSettings, StageNode
from stage.package_client import CoordinatorPackageSource
from stage.servicers import ControlServicer, DataServicer

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 20.0


def default_cache_dir() -> Path:
    home = Path(os.environ.get("MESH_HOME", Path.home() / ".cache" / "mesh"))
    return home / "slices"


def default_node_id(cache_dir: Path) -> str:
    """Stable per host and cache directory: a stage restarted the same way rejoins
    under the same id (and the coordinator puts it back in its place)."""
    digest = hashlib.sha256(str(cache_dir.resolve()).encode()).hexdigest()[:6]
    return f"{socket.gethostname()}-{digest}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mesh-stage", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    join = sub.add_parser("join", help="join a coordinator and serve a layer range")
    add_stage_arguments(join)
    return parser


def add_stage_arguments(join: argparse.ArgumentParser) -> None:
    join.add_argument("--coordinator", required=True, help="coordinator HOST:PORT")
    join.add_argument("--listen", default="0.0.0.0:7071", help="gRPC bind HOST:PORT (port 0: any)")
    join.add_argument(
        "--advertise",
        default=None,
        help="host other nodes use to reach this one (default: the listen host, or, when "
        "listening on 0.0.0.0, this host's address on the route to the coordinator)",
    )
    join.add_argument(
        "--node-id",
        default=None,
        help="node name; default: the host name and a digest of the cache directory, the "
        "same on every restart, so a restarted stage takes its place back",
    )
    join.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    join.add_argument("--memory", default="0", help="memory offered, e.g. 20GiB (0: unknown)")
    join.add_argument("--speed", type=float, default=1.0, help="relative speed hint")
    join.add_argument("--cache-dir", type=Path, default=None, help="slice cache directory")
    join.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    join.add_argument(
        "--compile",
        action="store_true",
        help="run decode steps through torch.compile (compiles while loading; "
        "falls back to eager where it cannot compile)",
    )
    join.add_argument(
        "--quantised-gemm",
        action="store_true",
        help="CPU int4/int8 linears of 64+ rows (long prefill chunks) dequantise and "
        "run a float32 GEMM: 1.25-2x faster there, but a row's result then depends on "
        "the rows beside it, so answers may change with load (implies "
        "--row-invariant off)",
    )
    join.add_argument(
        "--row-invariant",
        choices=("auto", "on", "off"),
        default="auto",
        help="compute every token's row the same way whether it runs alone, in a verify "
        "window or in a batch, so answers never change with load or speculation (CPU). "
        "auto: on for int4/int8 packages (costs them up to ~10%% decode speed), off for "
        "dense ones (costs float32/bfloat16 10-30%%); off: the previous kernels",
    )
    join.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="on a CUDA device, replay decode steps as CUDA graphs (checked against eager "
        "steps while loading; falls back to eager where they cannot be captured)",
    )
    join.add_argument("--frontend", action="store_true", help="host the OpenAI HTTP frontend")
    join.add_argument("--http-host", default="0.0.0.0", help="frontend bind host")
    join.add_argument("--http-port", type=int, default=8000, help="frontend port (0: any)")
    join.add_argument("--api-key-file", type=Path, default=None, help="file with the HTTP API key")
    join.add_argument("--max-sessions", type=int, default=16, help="frontend request limit")
    join.add_argument("--max-queued", type=int, default=32, help="frontend queue limit")
    join.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=DEFAULT_PREFIX_TOKENS,
        help="stage 0 (--frontend): positions of finished requests kept on every stage so "
        "that a later prompt starting with them skips their prefill (0: off)",
    )
    join.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=DEFAULT_PREFIX_BYTES / 2**20,
        help="most memory this stage gives to kept prefixes (least recently used first out; "
        "0: keep none)",
    )
    join.add_argument(
        "--inject-delay-ms",
        type=float,
        default=0.0,
        help="add this latency to every outgoing data hop (benchmarks; emulates a network)",
    )
    join.add_argument("--config", type=Path, default=None, help="mesh.toml (speculation, security)")
    join.add_argument("--log-level", default=None)
    add_speculation_arguments(join)
    add_security_arguments(join)


def run(args: argparse.Namespace) -> int:
    from mesh.runtime import invariant, linear

    if args.quantised_gemm:
        linear.QUANTISED_GEMM = True
        if args.row_invariant == "on":
            logger.warning("--quantised-gemm turns row-invariant arithmetic off")
    invariant.MODE = "off" if args.quantised_gemm else args.row_invariant
    if args.prefix_cache_tokens < 0 or args.prefix_cache_mb < 0:
        raise InvalidRequest(
            "--prefix-cache-tokens and --prefix-cache-mb take 0 (no prefix cache) or more"
        )
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    cache_dir = args.cache_dir or default_cache_dir()
    node_id = args.node_id or default_node_id(cache_dir)
    configure_logging(args.log_level, prefix=node_id)
    security = validate(security_from_args(args), serving=True)
    install(security)
    log_posture(security, f"stage {node_id}")
    server = new_server(32)
    port = bind(server, args.listen)
    host = advertise_host(split_host_port(args.listen)[0], args.advertise, args.coordinator)
    address = f"{url_host(host)}:{port}"
    node = StageNode(
        NodeSettings(
            node_id=node_id,
            cache_dir=cache_dir,
            device=args.device,
            inject_delay_ms=args.inject_delay_ms,
            compile=args.compile,
            cuda_graphs=args.cuda_graphs,
            prefix_cache_bytes=int(args.prefix_cache_mb * 2**20),
        ),
        address,
        remote=CoordinatorPackageSource(args.coordinator, node_id),
    )
    stage_pb2_grpc.add_StageControlServicer_to_server(ControlServicer(node), server)
    data_pb2_grpc.add_StageDataServicer_to_server(DataServicer(node, node.deliver_result), server)
    server.start()
    logger.info("stage %s serving gRPC at %s", node_id, address)
    http_url = ""
    frontend = None
    if args.frontend:
        from stage.frontend.host import start_frontend

        frontend = start_frontend(node, args, host)
        http_url = frontend.url
    membership = Membership(
        args.coordinator,
        lambda: JoinRequest(
            node_id=node_id,
            address=address,
            device=args.device,
            memory_bytes=parse_bytes(args.memory),
            speed_hint=args.speed,
            frontend=args.frontend,
            http_url=http_url,
            term=node.term,
        ),
        node.heartbeat,
        on_term=node.observe_coordinator_term,
    )
    node.on_newer_term(membership.poke)
    membership.start()
    stopped = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logger.info("signal %s: stopping", signum)
        stopped.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    watch_parent(stopped.set)
    stopped.wait()
    # Whatever happens while shutting down, the process ends.
    deadline = threading.Timer(SHUTDOWN_GRACE_S, lambda: os._exit(1))
    deadline.daemon = True
    deadline.start()
    membership.stop()
    if frontend is not None:
        frontend.stop()
    node.stop()
    server.stop(grace=1.0).wait()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except MeshError as error:
        sys.stderr.write(f"mesh-stage: {error.message}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
