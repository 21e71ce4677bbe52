"""`mesh-stage doctor`: check the setup `join` would start with, on this host.

It takes `join`'s flags (and TOML, and environment), resolves them the way `join`
does, and checks: the configuration, the join token and TLS files, the ports, the
device, the quantised CPU kernels, the cache directory, the coordinator (reachable
within a short deadline, every call with a deadline), the package it serves (on
this host, or the slice already cached here), the memory this stage offers, and
with ``--frontend`` the draft model. Nothing is joined or loaded.
"""

from __future__ import annotations

import argparse
import json
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc

from mesh.codec import PackageManifestReply, PackageManifestRequest, StatusReply, StatusRequest
from mesh.config import cli_speculation_args, resolve_speculation
from mesh.discovery import find_coordinator, parse_auto
from mesh.doctor import CheckResult, configure_doctor_logging, failed, passed, report, run, warned
from mesh.doctor.host import (
    check_device,
    check_port,
    check_quantised_kernels,
    check_writable,
    device_memory,
)
from mesh.doctor.package import check_draft, check_package
from mesh.doctor.tls import check_security
from mesh.errors import InvalidRequest, MeshError, PackageError
from mesh.grpc_util import channel
from mesh.netaddr import advertise_host, split_host_port
from mesh.package.manifest import PackageManifest
from mesh.package.resolver import slice_dir_name
from mesh.package.verify import verify_files
from mesh.proto.v1 import coordinator_pb2_grpc
from mesh.security import MeshSecurity, security_from_args, unavailable_hint
from mesh.settings.commands import JoinConfig
from mesh.units import format_bytes
from stage.cli import default_cache_dir, resolve_join

# The doctor waits this long for the coordinator (a TCP connection, then gRPC).
REACH_DEADLINE_S = 3.0
CONFIG_FIX = "fix that key; `mesh-stage join --print-config` shows every setting and its source"


@dataclass(frozen=True)
class CoordinatorView:
    """What the coordinator told the doctor (None where it did not answer)."""

    status: StatusReply | None = None
    manifest: PackageManifest | None = None


def run_doctor(args: argparse.Namespace) -> int:
    configure_doctor_logging(args)
    return report(diagnose(args), args.json)


def diagnose(args: argparse.Namespace) -> list[CheckResult]:
    try:
        config = resolve_join(args)
    except MeshError as error:
        return [failed("config", error.message, CONFIG_FIX)]
    stage = config.stage.value
    source = f"{args.config}" if getattr(args, "config", None) else "no --config file"
    results = [passed("config", f"{source}: every key known and valid")]
    cache_dir = stage.cache_dir or default_cache_dir()
    security = MeshSecurity()
    try:
        security = security_from_args(args)
    except MeshError as error:
        results.append(failed("security", error.message, CONFIG_FIX))
    else:
        results += run([("security", lambda: check_security(security, _dialled(config)))])
    results += run(
        [
            ("ports", lambda: _ports(config)),
            ("device", lambda: check_device(stage.device)),
            (
                "quantised kernels",
                lambda: check_quantised_kernels(stage.device, stage.quantised_kernel),
            ),
        ]
    )
    view = CoordinatorView()
    try:
        address = _discovered(stage.coordinator, security, results)
        reached, view = contact(address, security, stage.node_id or "doctor")
    except MeshError as error:
        reached = failed("coordinator", error.message, "check --coordinator")
    results.append(reached)
    need = sum(e.bytes for e in view.manifest.files) if view.manifest else 0
    results += run(
        [
            ("cache dir", lambda: check_writable(cache_dir, "--cache-dir", need)),
            ("package", lambda: check_served_package(view, cache_dir)),
            ("memory", lambda: _memory(config, view.manifest)),
        ]
    )
    if stage.frontend:
        results += run([("speculation", lambda: _speculation(args, config, view))])
    return results


def _discovered(coordinator: str, security: MeshSecurity, results: list[CheckResult]) -> str:
    """The coordinator's address: as given, or (``auto``) the one that answered
    discovery, with a result for the search."""
    port = parse_auto(coordinator)
    if port is None:
        return coordinator
    try:
        offer = find_coordinator(port, security.join_token, REACH_DEADLINE_S)
    except MeshError as error:
        results.append(
            failed(
                "discovery",
                error.message,
                f"start `mesh-coordinator up` on this network, open UDP {port} on its host, "
                "or give --coordinator HOST:PORT",
            )
        )
        raise
    results.append(passed("discovery", f"{offer.address} answered (serving {offer.model_id})"))
    return offer.address


def _dialled(config: JoinConfig) -> list[tuple[str, str]]:
    stage = config.stage.value
    listen_host, _ = split_host_port(stage.listen)
    host = advertise_host(listen_host, stage.advertise, stage.coordinator)
    return [(host, "--advertise" if stage.advertise else "advertised")]


def _ports(config: JoinConfig) -> list[CheckResult]:
    stage, serving = config.stage.value, config.frontend.value
    try:
        host, port = split_host_port(stage.listen)
    except ValueError as error:
        return [failed("port", f"--listen: {error}", "write it as HOST:PORT, e.g. 0.0.0.0:7071")]
    results = [check_port(host, port, "--listen")]
    if stage.data_transport == "tcp":
        results.append(check_port(host, stage.data_port, "--data-port"))
    if stage.frontend:
        results.append(check_port(serving.http_host, serving.http_port, "--http-port"))
    return results


def contact(
    address: str, security: MeshSecurity, node_id: str
) -> tuple[CheckResult, CoordinatorView]:
    """Reach the coordinator: a TCP connection, a gRPC channel ready, then its Status
    and the manifest of the package it serves, each within REACH_DEADLINE_S."""
    try:
        host, port = split_host_port(address)
    except ValueError as error:
        raise InvalidRequest(f"--coordinator: {error}") from None
    try:
        socket.create_connection((host, port), timeout=REACH_DEADLINE_S).close()
    except ConnectionRefusedError:
        return failed(
            "coordinator",
            f"nothing listens at {address} (connection refused)",
            "start `mesh-coordinator up` there, or fix --coordinator",
        ), CoordinatorView()
    except OSError as error:
        return failed(
            "coordinator",
            f"no connection to {address} within {REACH_DEADLINE_S:g} s ({error})",
            "check the address, the route and firewalls between the hosts",
        ), CoordinatorView()
    ch = channel(address, security)
    try:
        try:
            grpc.channel_ready_future(ch).result(timeout=REACH_DEADLINE_S)
        except grpc.FutureTimeoutError:
            return failed(
                "coordinator",
                f"{address} accepts connections but gRPC is not ready within "
                f"{REACH_DEADLINE_S:g} s",
                unavailable_hint(security),
            ), CoordinatorView()
        status = StatusReply.from_proto(
            coordinator_pb2_grpc.CoordinatorStub(ch).Status(
                StatusRequest().to_proto(), timeout=REACH_DEADLINE_S
            )
        )
        reply = coordinator_pb2_grpc.PackageFilesStub(ch).Manifest(
            PackageManifestRequest(status.package_ref, node_id).to_proto(),
            timeout=REACH_DEADLINE_S,
        )
    except grpc.RpcError as error:
        code = error.code()
        fix = unavailable_hint(security)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            fix = "give every node the same join token (MESH_JOIN_TOKEN or --join-token-file)"
        return failed(
            "coordinator", f"{address} answered {code.name}: {error.details()}", fix
        ), CoordinatorView()
    finally:
        ch.close()
    try:
        body = json.loads(PackageManifestReply.from_proto(reply).manifest_json)
    except ValueError as error:
        raise PackageError(f"the manifest from {address} is not JSON: {error}") from None
    manifest = PackageManifest.from_json(body, origin=f"the manifest from {address}")
    detail = (
        f"{address} answers: state {status.state}, model {status.model_id or '-'}, package "
        f"{status.package_ref}"
    )
    return passed("coordinator", detail), CoordinatorView(status, manifest)


def check_served_package(view: CoordinatorView, cache_dir: Path) -> CheckResult:
    """The package the coordinator serves: verified whole when this host has it at the
    same path; otherwise the files of it cached here."""
    if view.status is None or view.manifest is None:
        return warned("package", "not checked: the coordinator did not answer", "see above")
    ref = view.status.package_ref
    if Path(ref).is_dir():
        return check_package(Path(ref))
    manifest = view.manifest
    slice_dir = cache_dir / slice_dir_name(manifest)
    cached = [e for e in manifest.files if (slice_dir / e.path).is_file()]
    source = f"{manifest.model_id} comes from the coordinator ({ref} is not on this host)"
    if not cached:
        return passed("package", f"{source}; nothing cached in {slice_dir} yet")
    problems = verify_files(slice_dir, cached, manifest=manifest)
    if problems:
        return warned(
            "package",
            f"{source}; {len(problems)} cached file(s) in {slice_dir} are damaged: {problems[0]}",
            "the stage fetches them again when it loads; or delete them",
        )
    return passed(
        "package",
        f"{source}; {len(cached)} file(s) cached in {slice_dir}, sha256 and headers verified",
    )


def _memory(config: JoinConfig, manifest: PackageManifest | None) -> CheckResult:
    """What this stage offers (``--memory``; unstated: unlimited to the planner)
    against its device's memory and, with the manifest, the planner's rule: a stage
    that cannot hold one layer (stage 0: and the embeddings) is left out. The prefix
    cache comes on top of what the planner gives."""
    stage = config.stage.value
    memory = device_memory(stage.device)
    offered = stage.memory
    if memory is None:
        return warned("memory", f"{stage.device} is not on this host", "see the device line")
    have = (
        f"{stage.device} has {format_bytes(memory.available_bytes)} available of "
        f"{format_bytes(memory.total_bytes)}"
    )
    shown = f"--memory {format_bytes(offered)}" if offered else "--memory unstated"
    if offered > memory.total_bytes:
        return failed(
            "memory",
            f"{shown} is more than {have}",
            "offer at most what the device has: the planner trusts --memory",
        )
    prefix = int(stage.prefix_cache_mb * 2**20)
    if manifest is None:
        return passed("memory", f"{shown}; {have}; the package's size is not known here")
    layer = max(e.bytes for e in manifest.files if e.kind == "layer")
    embed = sum(e.bytes for e in manifest.files if e.kind == "embed") if stage.frontend else 0
    whole = sum(e.bytes for e in manifest.files if e.kind != "meta")
    if offered and offered < layer + embed:
        return failed(
            "memory",
            f"{shown} cannot hold one layer ({format_bytes(layer)} of weights"
            + (f", and {format_bytes(embed)} of embeddings on stage 0" if embed else "")
            + "): the planner leaves this stage out",
            "offer more --memory, or use a quantised package",
        )
    if offered and offered + prefix > memory.available_bytes:
        return warned(
            "memory",
            f"{shown} and up to {format_bytes(prefix)} of prefix cache are more than {have}",
            "lower --memory or --prefix-cache-mb",
        )
    if not offered and memory.available_bytes < whole + prefix:
        fits = max(0, memory.available_bytes - embed - prefix) // layer
        return warned(
            "memory",
            f"{shown} (the planner treats this stage as unlimited) and {have}: about "
            f"{fits} of {manifest.layer_count} layers fit",
            "state --memory so the planner gives this stage no more than it holds",
        )
    return passed(
        "memory",
        f"{shown}; {have}; one layer is {format_bytes(layer)}, the whole package "
        f"{format_bytes(whole)}, up to {format_bytes(prefix)} of prefix cache (KV comes on "
        "top, as the coordinator's sessions decide)",
    )


def _speculation(
    args: argparse.Namespace, config: JoinConfig, view: CoordinatorView
) -> CheckResult:
    if view.manifest is None:
        return warned("draft model", "not checked: no manifest from the coordinator", "see above")
    ref = view.status.package_ref if view.status else ""
    try:
        speculation = resolve_speculation(
            cli_speculation_args(args),
            dict(config.toml),
            view.manifest.model_id,
            view.manifest.generation,
            no_draft=args.no_draft,
        )
    except InvalidRequest as error:
        return failed("speculation", error.message, CONFIG_FIX)
    return check_draft(speculation, Path(ref) if Path(ref).is_dir() else None)
