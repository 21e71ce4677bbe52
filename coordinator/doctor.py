"""`mesh-coordinator doctor`: check the setup `up` would start with, on this host.

It takes `up`'s flags (and TOML, and environment), resolves them the way `up` does,
and checks: the configuration, the package, speculation and the draft model, the
join token and TLS files, the ports `up` listens on, the local stages' device, and
whether the layer plan fits this host's memory. Nothing is started or built.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from coordinator.cli import resolve_up
from coordinator.model import ModelInfo, read_model
from coordinator.planner import NodeCapacity, footprint_from_manifest, plan_layers
from mesh.config import cli_speculation_args, resolve_speculation
from mesh.doctor import (
    CheckResult,
    configure_doctor_logging,
    failed,
    passed,
    report,
    run,
    warned,
)
from mesh.doctor.host import check_device, check_port, check_udp_port, device_memory
from mesh.doctor.package import REBUILD, check_draft, check_package
from mesh.doctor.tls import check_security
from mesh.errors import InvalidRequest, MeshError
from mesh.netaddr import advertise_host, is_wildcard, split_host_port
from mesh.package.manifest import MANIFEST_NAME
from mesh.security import security_from_args
from mesh.settings import kv_sessions
from mesh.settings.commands import UpConfig
from mesh.units import format_bytes

# Local stages planned above this share of the memory available: WARN.
TIGHT_SHARE = 0.8
CONFIG_FIX = "fix that key; `mesh-coordinator up --print-config` shows every setting and its source"


@dataclass(frozen=True)
class LocalPackage:
    """The package `up` would serve, as far as this host has it: ``directory`` when it
    is a local directory (verified), ``model`` when its manifest and config could be
    read (for the memory plan), ``result`` the package check's line."""

    result: CheckResult
    directory: Path | None = None
    model: ModelInfo | None = None


def run_doctor(args: argparse.Namespace) -> int:
    configure_doctor_logging(args)
    return report(diagnose(args), args.json)


def diagnose(args: argparse.Namespace) -> list[CheckResult]:
    """Every check of `up`'s setup; the configuration first (without it, nothing else
    can be checked)."""
    try:
        config = resolve_up(args)
    except MeshError as error:
        return [failed("config", error.message, CONFIG_FIX)]
    source = f"{args.config}" if getattr(args, "config", None) else "no --config file"
    results = [passed("config", f"{source}: every key known and valid")]
    try:
        package = local_package(config.coordinator.value.model, config.coordinator.value.quant)
    except MeshError as error:
        package = LocalPackage(failed("package", error.message, REBUILD))
    results.append(package.result)
    results += run(
        [
            ("speculation", lambda: _speculation(args, config, package)),
            ("security", lambda: check_security(security_from_args(args), _dialled(config))),
            ("ports", lambda: _ports(config)),
            ("device", lambda: _device(config)),
            ("memory", lambda: _memory(config, package.model)),
        ]
    )
    return results


def local_package(ref: str, quant: str | None) -> LocalPackage:
    """Find the package ``--model`` names without building or downloading anything."""
    from mesh.package import hub
    from mesh.package.default import default_package_dir

    if quant and ref != "default":
        return LocalPackage(
            failed("package", "--quant applies to --model default", "pass a package directory")
        )
    if ref == "default":
        directory = default_package_dir(quant)
        if not (directory / MANIFEST_NAME).is_file():
            return LocalPackage(
                warned(
                    "package",
                    f"the default package is not built yet ({directory})",
                    "`up` builds it from the installed SmolLM2 wheel when it starts",
                )
            )
    elif Path(ref).expanduser().is_dir():
        directory = Path(ref).expanduser().resolve()
    else:
        repo = hub.parse_repo_ref(ref)
        if repo is None:
            return LocalPackage(
                failed(
                    "package",
                    f"--model {ref!r} is neither a package directory on this host nor a "
                    "Hugging Face repo id (org/name[@revision])",
                    "pass the package directory (built with `mesh-package build`)",
                )
            )
        return LocalPackage(
            warned(
                "package",
                f"{ref} is a Hugging Face repo: not verified here (stages verify every file "
                "they download)",
                "to check it here, download it and pass the directory",
            )
        )
    result = check_package(directory)
    if result.status != "PASS":
        if ref == "default":
            result = failed(result.check, result.detail, f"delete {directory}; `up` rebuilds it")
        return LocalPackage(result, directory)
    return LocalPackage(result, directory, read_model(str(directory)))


def _speculation(args: argparse.Namespace, config: UpConfig, package: LocalPackage) -> CheckResult:
    if package.model is None:
        return warned("draft model", "not checked: no package to check it against", "see above")
    manifest = package.model.manifest
    try:
        speculation = resolve_speculation(
            cli_speculation_args(args),
            dict(config.toml),
            manifest.model_id,
            manifest.generation,
            no_draft=args.no_draft,
        )
    except InvalidRequest as error:
        return failed("speculation", error.message, CONFIG_FIX)
    return check_draft(speculation, package.directory)


def _dialled(config: UpConfig) -> list[tuple[str, str]]:
    """The hosts peers dial to reach this coordinator: the advertised one, and the
    listen host when it is a specific address (local stages dial it)."""
    coord = config.coordinator.value
    listen_host, _ = split_host_port(coord.listen)
    advertised = advertise_host(listen_host, coord.advertise)
    where = "--advertise" if coord.advertise else "advertised"
    hosts = [(advertised, where)]
    if not is_wildcard(listen_host) and listen_host != advertised:
        hosts.append((listen_host, "--listen"))
    return hosts


def _ports(config: UpConfig) -> list[CheckResult]:
    coord, serving = config.coordinator.value, config.frontend.value
    try:
        host, port = split_host_port(coord.listen)
    except ValueError as error:
        return [failed("port", f"--listen: {error}", "write it as HOST:PORT, e.g. 0.0.0.0:7070")]
    results = [check_port(host, port, "--listen")]
    if coord.discovery and port != 0:
        results.append(check_udp_port(host, port, "LAN discovery"))
    if not coord.no_local_stage:
        results.append(check_port(serving.http_host, serving.http_port, "--http-port"))
        for flag, fixed in (
            ("--stage0-port", coord.stage0_port),
            ("--stage0-data-port", coord.stage0_data_port),
        ):
            if fixed:
                results.append(check_port(host, fixed, flag))
    return results


def local_stage_count(config: UpConfig) -> int:
    coord = config.coordinator.value
    return (0 if coord.no_local_stage else 1) + coord.spawn_stages


def _device(config: UpConfig) -> CheckResult:
    if not local_stage_count(config):
        return passed("device", "no local stages (--no-local-stage): stages check their own")
    return check_device(config.stage.value.device)


def _memory(config: UpConfig, model: ModelInfo | None) -> CheckResult:
    """Plan the layers as `up` would (the local stages first, stage 0 the frontend;
    stages still to join as unstated memory) and compare what the local stages are
    given, with the KV cache of every session and each stage's prefix cache, with
    the memory of their device on this host."""
    local = local_stage_count(config)
    if not local:
        return passed("memory", "no local stages: each stage's doctor checks its own")
    if model is None:
        return warned("memory", "not checked: no package to plan", "see the package line")
    coord, stage = config.coordinator.value, config.stage.value
    footprint = footprint_from_manifest(
        model.manifest,
        dtype=coord.dtype,
        max_sessions=kv_sessions(coord, config.frontend.value),
        max_tokens_per_session=coord.max_tokens_per_session or model.context_length,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
    )
    # Local stages measure their device: `up` passes them no --memory, nor its
    # --config, and they do not inherit MESH_STAGE_* variables (as `up` says).
    first = not coord.no_local_stage
    nodes = [NodeCapacity(f"local-{i}", "", 0, frontend=first and i == 0) for i in range(local)]
    nodes += [NodeCapacity(f"joining-{i}", "", 0) for i in range(max(coord.min_stages, 1) - local)]
    try:
        plan = plan_layers(nodes, footprint, max_stages=coord.max_stages or None)
    except InvalidRequest as error:
        return failed("memory", f"the layers cannot be planned: {error.message}", _LOWER)
    mine = [s for s in plan.stages if s.node_id.startswith("local-")]
    prefix = int(stage.prefix_cache_mb * 2**20) * len(mine)
    need = sum(s.planned_bytes for s in mine) + prefix
    memory = device_memory(stage.device)
    shares = ", ".join(f"stage {s.stage_index} layers {s.layer_range}" for s in mine)
    detail = (
        f"{len(mine)} local stage(s) of {len(plan.stages)} ({shares}) need "
        f"{format_bytes(need)}: weights, KV for "
        f"{kv_sessions(coord, config.frontend.value)} session(s) x "
        f"{coord.max_tokens_per_session or model.context_length} positions, "
        f"up to {format_bytes(prefix)} of prefix cache"
    )
    if memory is None:
        return warned(
            "memory",
            f"{detail}; {stage.device} is not on this host",
            "fix --device (see the device line)",
        )
    detail += (
        f"; {stage.device} has {format_bytes(memory.available_bytes)} available of "
        f"{format_bytes(memory.total_bytes)}"
    )
    if need > memory.available_bytes:
        return failed("memory", detail + ": it cannot fit", _LOWER)
    if need > TIGHT_SHARE * memory.available_bytes:
        return warned("memory", detail + ": tight", _LOWER)
    return passed("memory", detail)


_LOWER = (
    "lower --kv-max-sessions or --max-tokens-per-session, use a quantised package, or add "
    "stages on other hosts (--min-stages, --no-local-stage)"
)
