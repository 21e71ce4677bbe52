"""`mesh-coordinator`: run the coordinator (`up`), show the topology (`status`),
create TLS certificates for a cluster (`certs`), or check a host's setup (`doctor`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc

from coordinator.certs import add_certs_parser, run_certs
from coordinator.driver import LoadSettings
from coordinator.local_stages import LocalStages
from coordinator.model import read_model
from coordinator.server import CoordinatorService, CoordinatorSettings, serve
from coordinator.stage0_budget import stage0_extra_bytes
from coordinator.state_file import (
    record_term,
    served_before,
    served_http,
    term_floor,
    update_state,
)
from coordinator.topology_view import StageStatusView, StatusView, render_status
from mesh.api_keys import parse_keys
from mesh.codec import StatusReply, StatusRequest, WireDType
from mesh.config import (
    add_speculation_arguments,
    cli_speculation_args,
    resolve_speculation,
    speculation_layers,
)
from mesh.discovery import DiscoveryResponder
from mesh.doctor import add_doctor_arguments
from mesh.errors import InvalidRequest, MeshError
from mesh.grpc_util import CONTROL_DEADLINE_S, channel
from mesh.lifetime import PARENT_PID_ENV
from mesh.logsetup import configure_logging
from mesh.metrics import (
    check_local_stage_metrics_ports,
    local_stage_metrics_argv,
    serve_metrics,
)
from mesh.netaddr import (
    advertise_host,
    bind_problem,
    host_port_setting,
    is_wildcard,
    split_host_port,
    url_host,
)
from mesh.package.default import default_package_dir
from mesh.package.embedded import DEFAULT_MODEL_ID
from mesh.package.manifest import MANIFEST_NAME
from mesh.proto.v1 import coordinator_pb2_grpc
from mesh.security import (
    TOKEN_ENV,
    MeshSecurity,
    active,
    add_security_arguments,
    install,
    log_posture,
    security_from_args,
    security_settings,
    unavailable_hint,
    validate,
)
from mesh.settings import (
    LOCAL_STAGE_FIELDS,
    CoordinatorConfig,
    FrontendConfig,
    StageConfig,
    add_arguments,
    kv_sessions,
    resolve,
)
from mesh.settings.commands import (
    STALL_TIMEOUT_KEY,
    UpConfig,
    add_config_arguments,
    print_config,
    read_config,
    serving_settings,
)
from mesh.settings.tree import env_name

logger = logging.getLogger(__name__)

DEFAULT_MODEL = CoordinatorConfig.model


def _dial_address(text: str) -> str:
    """argparse type of an address to dial: HOST:PORT, port 1-65535."""
    try:
        return host_port_setting(any_port=False)(text)
    except InvalidRequest as error:
        raise argparse.ArgumentTypeError(error.message) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mesh-coordinator", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run the coordinator (and local stages)")
    add_up_arguments(up)
    status = sub.add_parser("status", help="print the topology")
    status.add_argument(
        "--coordinator", default="127.0.0.1:7070", type=_dial_address, help="HOST:PORT"
    )
    status.add_argument("--json", action="store_true", help="print JSON")
    add_security_arguments(status)
    add_certs_parser(sub)
    doctor = sub.add_parser("doctor", help="check this host's setup for `up` (takes up's flags)")
    add_up_arguments(doctor)
    add_doctor_arguments(doctor)
    return parser


def add_up_arguments(up: argparse.ArgumentParser) -> None:
    """``up``'s flags: the [coordinator] section, the [stage] fields of the local
    stages, the [frontend] section (stage 0), speculation and security."""
    add_config_arguments(up)
    add_arguments(up, CoordinatorConfig)
    add_arguments(up.add_argument_group("local stages"), StageConfig, only=LOCAL_STAGE_FIELDS)
    add_arguments(up.add_argument_group("stage 0 (OpenAI API, engine core)"), FrontendConfig)
    add_speculation_arguments(up)
    add_security_arguments(up)


STAGE_ENV_PREFIX = "MESH_STAGE_"


def resolve_up(args: argparse.Namespace) -> UpConfig:
    """Resolve ``up``'s configuration once (CLI > environment > TOML > built-in) and
    check it whole, speculation included; errors name the key and its source."""
    toml, source = read_config(args)
    given = vars(args)
    local = {name: given[name] for name in LOCAL_STAGE_FIELDS if name in given}
    config = UpConfig(
        coordinator=resolve(CoordinatorConfig, "coordinator", args, toml, toml_source=source),
        stage=resolve(StageConfig, "stage", local, toml, toml_source=source),
        frontend=resolve(FrontendConfig, "frontend", args, toml, toml_source=source),
        toml=toml,
    )
    ignored = sorted(
        set(toml.get("stage", {}) if isinstance(toml.get("stage"), dict) else ())
        - set(LOCAL_STAGE_FIELDS)
    )
    local_env = {env_name("stage", name) for name in LOCAL_STAGE_FIELDS}
    ignored_env = sorted(
        k for k in os.environ if k.startswith(STAGE_ENV_PREFIX) and k not in local_env
    )
    for keys, where in ((ignored, f"[stage] {{}} from {source}"), (ignored_env, "{}")):
        if keys:
            logger.warning(
                "up does not take %s for its local stages (those are `mesh-stage join` "
                "settings); fix the local stage 0's ports with [coordinator] stage0_port "
                "and stage0_data_port (--stage0-port, --stage0-data-port)",
                where.format(", ".join(keys)),
            )
    coordinator = config.coordinator.value
    if coordinator.max_stages and coordinator.min_stages > coordinator.max_stages:
        raise InvalidRequest(
            f"min_stages {coordinator.min_stages} ({config.coordinator.origin('min_stages')}) "
            f"is above max_stages {coordinator.max_stages} "
            f"({config.coordinator.origin('max_stages')}): the mesh would wait for stages "
            "it may not use; lower min_stages or raise max_stages"
        )
    return config


def _resolve_model_ref(ref: str, quant: str | None = None) -> str:
    if Path(ref).expanduser().is_dir():
        # Stages get the absolute path: the same path on a shared file system, or the
        # name they ask the coordinator for when they cannot read it.
        ref = str(Path(ref).expanduser().resolve())
    if ref != DEFAULT_MODEL:
        if quant:
            raise InvalidRequest(
                "--quant applies to --model default; quantise other models with "
                "`mesh-package build SRC --out DIR --quant ...` and pass --model DIR"
            )
        return ref
    from mesh.package.default import build_default_package

    logger.info("building the default package (SmolLM2-135M-Instruct) if needed ...")
    return str(build_default_package(quant=quant))


def local_stage_argv(
    coordinator: str,
    index: int,
    config: UpConfig,
    threads: int,
    frontend: bool,
    security: MeshSecurity,
    listen_host: str = "127.0.0.1",
    advertise: str = "127.0.0.1",
) -> list[str]:
    """The command line of local stage ``index`` started by ``up``: it listens on
    ``listen_host`` (where the coordinator listens) and advertises ``advertise``,
    so that stages on other hosts can reach it. Stage 0's serving and speculation
    settings are not flags: they reach it with every Load."""
    stage = config.stage.value
    head = config.coordinator.value
    # Stage 0 is the one stages on other hosts reach (its return link): its ports may
    # be fixed; other local stages take free ones (several share this host).
    port = head.stage0_port if frontend else 0
    command = [
        sys.executable,
        # -P: the working directory is not searched first, so a folder of the
        # operator's named mesh/ or stage/ cannot shadow the installed packages.
        "-P",
        "-m",
        "stage.cli",
        "join",
        "--coordinator",
        coordinator,
        "--listen",
        f"{url_host(listen_host)}:{port}",
        "--advertise",
        advertise,
        "--node-id",
        f"local-{index}",
        "--threads",
        str(threads),
    ]
    for name in LOCAL_STAGE_FIELDS:
        value = getattr(stage, name)
        if name == "cache_dir":
            if value is not None:
                command += ["--cache-dir", str(value / f"local-{index}")]
        elif isinstance(value, bool):
            command.append(("--" if value else "--no-") + name.replace("_", "-"))
        else:
            command += [
                "--" + name.replace("_", "-"),
                f"{value:g}" if isinstance(value, float) else str(value),
            ]
    log_level = config.coordinator.value.log_level
    if log_level:
        command += ["--log-level", log_level]
    command += security.child_argv()
    if frontend and head.stage0_data_port:
        command += ["--data-port", str(head.stage0_data_port)]
    if frontend:
        serving = config.frontend.value
        command += [
            "--frontend",
            "--http-host",
            serving.http_host,
            "--http-port",
            str(serving.http_port),
            "--drain-timeout",
            f"{serving.drain_timeout:g}",
            "--reasoning-format",
            serving.reasoning_format,
            "--stored-responses",
            str(serving.stored_responses),
            "--embedding-pooling",
            serving.embedding_pooling,
            "--sampling-defaults",
            serving.sampling_defaults,
        ]
        if serving.api_key_file is not None:
            command += ["--api-key-file", str(serving.api_key_file.expanduser().absolute())]
    return command


def check_port_free(host: str, port: int, flag: str) -> None:
    """Refuse to start when ``host:port`` cannot be bound (another server holds it):
    stage 0 would fail to serve there, and the mesh would wait for it forever."""
    if port == 0:
        return
    problem = bind_problem(host, port)
    if problem is not None:
        raise InvalidRequest(
            f"cannot listen on {url_host(host)}:{port} ({problem}); another "
            f"process holds it: stop it or choose another {flag}"
        )


def _print_up_config(args: argparse.Namespace, config: UpConfig) -> int:
    """``up --print-config``: every setting with its value and source, building and
    starting nothing. The default package is read only once it is built (its
    speculation block then shows among the layers)."""
    coord = config.coordinator.value
    model_id, generation = DEFAULT_MODEL_ID, None
    ref: str | None = coord.model
    if ref == DEFAULT_MODEL:
        built = default_package_dir(coord.quant)
        ref = str(built) if (built / MANIFEST_NAME).is_file() else None
    if ref is not None:
        model = read_model(_resolve_model_ref(ref))
        model_id, generation = model.manifest.model_id, model.manifest.generation
    given = cli_speculation_args(args)
    speculation = speculation_layers(given, dict(config.toml), model_id)
    resolve_speculation(given, dict(config.toml), model_id, generation, no_draft=args.no_draft)
    extra = [
        (f"speculation.{k}", v, where) for where, layer in speculation for k, v in layer.items()
    ]
    print_config(
        [config.coordinator, config.stage, config.frontend], extra + security_settings(args)
    )
    return 0


def _spawn_stage(command: list[str], security: MeshSecurity) -> subprocess.Popen:
    # Up gives its local stages their settings on the command line; a MESH_STAGE_*
    # variable of up's environment is not theirs (MESH_STAGE_DATA_PORT would have
    # every local stage bind the same port), as [stage] keys of up's file are not.
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(STAGE_ENV_PREFIX)}
    # The stage exits when this process dies, however it dies (see mesh.lifetime).
    env = security.child_env(inherited) | {PARENT_PID_ENV: str(os.getpid())}
    return subprocess.Popen(command, env=env, start_new_session=True)


def up(args: argparse.Namespace) -> int:
    config = resolve_up(args)
    coord = config.coordinator.value
    serving = config.frontend.value
    configure_logging(coord.log_level, prefix="coordinator")
    if args.print_config:
        return _print_up_config(args, config)
    # What cannot work is refused before anything is said about the rest.
    ref = _resolve_model_ref(coord.model, coord.quant)
    model = read_model(ref)
    speculation = speculation_layers(
        cli_speculation_args(args), dict(config.toml), model.manifest.model_id
    )
    # Checked here whole (with the package's block), so a bad flag fails at start.
    resolved = resolve_speculation(
        cli_speculation_args(args),
        dict(config.toml),
        model.manifest.model_id,
        model.manifest.generation,
        no_draft=args.no_draft,
    )
    if not coord.no_local_stage:
        check_port_free(serving.http_host, serving.http_port, "--http-port")
        if serving.api_key_file is not None:
            # Stage 0 reads the file; a bad one is said here, before anything starts.
            path = serving.api_key_file.expanduser()
            try:
                parse_keys(path.read_text(), str(path))
            except OSError as error:
                raise InvalidRequest(f"cannot read the API key file {path}: {error}") from None
    security = validate(security_from_args(args), serving=True)
    install(security)
    log_posture(security, "the coordinator")
    local = (0 if coord.no_local_stage else 1) + coord.spawn_stages
    max_tokens = coord.max_tokens_per_session or model.context_length
    sent = serving_settings(config.frontend, speculation)
    sent += (
        (
            STALL_TIMEOUT_KEY,
            json.dumps(coord.stall_timeout),
            config.coordinator.origin("stall_timeout"),
        ),
    )
    if args.no_draft:
        sent += (("speculation.no_draft", "true", "CLI --no-draft"),)
    settings = CoordinatorSettings(
        load=LoadSettings(
            package_ref=ref,
            manifest_sha256=model.manifest.sha256(),
            model_id=model.manifest.model_id,
            wire_dtype=WireDType.parse(coord.wire_dtype),
            torch_dtype=coord.dtype,
            max_sessions=kv_sessions(coord, serving),
            max_tokens_per_session=max_tokens,
            max_batch_tokens=serving.max_batch_tokens,
            serving=sent,
        ),
        min_stages=max(coord.min_stages, local, 1),
        max_stages=coord.max_stages,
        stage0_extra_bytes=stage0_extra_bytes(resolved, kv_sessions(coord, serving), max_tokens),
        rebalance_spread=coord.rebalance_spread,
        heartbeat_timeout_s=coord.heartbeat_timeout,
        stall_timeout_s=coord.stall_timeout,
        forget_dead_after_s=coord.forget_dead_after,
        load_attempts=coord.load_attempts,
        term_floor=term_floor(coord.state_file),
        served_before=served_before(coord.state_file, model.manifest.model_id),
        expect_frontend=not coord.no_local_stage
        or served_http(coord.state_file, model.manifest.model_id),
    )
    service = CoordinatorService(
        model, settings, on_term=lambda term: record_term(coord.state_file, term)
    )
    listen_host, _ = split_host_port(coord.listen)
    local_indices = range(0 if not coord.no_local_stage else 1, 1 + coord.spawn_stages)
    check_local_stage_metrics_ports(listen_host, coord.stage_metrics_port_base, local_indices)
    server, port = serve(service, coord.listen)
    serve_metrics(service.metrics.registry, listen_host, coord.metrics_port, who="the coordinator")
    advertise = advertise_host(listen_host, coord.advertise)
    # Local stages reach the coordinator on the address it listens on (loopback for a
    # wildcard, or the advertised name with TLS: the one its certificate names);
    # everyone else is told the advertised one.
    local_host = listen_host
    if is_wildcard(listen_host):
        local_host = advertise if security.tls_enabled else "127.0.0.1"
    address = f"{url_host(local_host)}:{port}"
    public = f"{url_host(advertise)}:{port}"
    logger.info("coordinator %s listening on %s", service.coordinator_id, address)
    if public != address:
        logger.info("other hosts reach this coordinator at %s", public)
    service.start()
    responder = DiscoveryResponder(
        listen_host,
        port,
        lambda: model.manifest.model_id,
        coord.advertise or "",
        security.tls_enabled,
        security.join_token,
        service.coordinator_id,
    )
    if coord.discovery:
        responder.start()
    threads = coord.stage_threads or max(1, (os.cpu_count() or 1) // max(1, local))
    stages = LocalStages(lambda argv: _spawn_stage(argv, security))
    for index in local_indices:
        argv = local_stage_argv(
            address, index, config, threads, index == 0, security, listen_host, advertise
        )
        argv += local_stage_metrics_argv(coord.stage_metrics_port_base, index)
        stages.start(index, argv)
    stopped = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stopped.set())
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    announced_term = 0
    exit_code = 0
    while not stopped.wait(0.25):
        if service.gave_up is not None:
            sys.stderr.write(f"mesh-coordinator: {service.gave_up}\n")
            exit_code = 1
            break
        state = service.state
        if state.mesh_state == "serving" and state.term != announced_term:
            announced_term = state.term
            _announce(
                service,
                public,
                coord.state_file,
                _banner_key(service, coord.no_local_stage, serving.api_key_file),
                _status_command(public, args, security),
            )
        if stopped.is_set():
            break
        failed = stages.check(served=bool(announced_term))
        if failed is not None:
            # Before the mesh first serves, a local stage that fails will fail again:
            # say so and stop rather than wait for a stage that never comes.
            sys.stderr.write(
                f"mesh-coordinator: local stage process {failed.process.pid} exited with "
                f"status {failed.process.returncode} before the mesh served (its error is "
                "above); stopping\n"
            )
            exit_code = 1
            break
    first, rest = stages.processes_by_stage0()
    logger.info("stopping: terminating %s local stage process(es)", len(first) + len(rest))

    def hurry(*_: object) -> None:
        # A second signal: stage 0 takes it as "stop without waiting for the running
        # requests" (its drain ends).
        logger.warning("signal again: stage 0 stops without waiting for its running requests")
        for process in first:
            if process.poll() is None:
                process.terminate()

    signal.signal(signal.SIGINT, hurry)
    signal.signal(signal.SIGTERM, hurry)
    service.stop()
    responder.stop()
    # Stage 0 first, which lets its running requests finish (--drain-timeout) on the
    # stages after it; then the others.
    _terminate(first, grace_s=10.0 + serving.drain_timeout)
    _terminate(rest)
    server.stop(grace=1.0).wait()
    return exit_code


def _key_example(key_file: Path | None) -> tuple[str, str]:
    """How the banner's examples pass the API key: (curl header, Python expression);
    the key itself is never printed."""
    if key_file is not None:
        path = str(key_file.expanduser().absolute())
        try:
            single = parse_keys(key_file.expanduser().read_text(), path).single_bare_key
        except (OSError, UnicodeDecodeError, InvalidRequest):
            single = True  # stage 0 says what is wrong with the file
        if not single:
            # Several keys (or a named one): the file is not the key itself.
            return (
                f' -H "Authorization: Bearer <a key from {path}>"',
                f"'<a key from {path}>'",
            )
        return (
            f' -H "Authorization: Bearer $(cat {path})"',
            f"open('{path}').read().strip()",
        )
    if os.environ.get("MESH_API_KEY"):
        return (' -H "Authorization: Bearer $MESH_API_KEY"', "os.environ['MESH_API_KEY']")
    return "", "'none'"


def _banner_key(
    service: CoordinatorService, no_local_stage: bool, key_file: Path | None
) -> tuple[str, str]:
    """``_key_example``; with ``--no-local-stage`` this process does not hold stage 0's
    keys, so for a frontend that refuses a request without one the examples show
    ``<an API key of stage 0>`` where the key goes."""
    key = _key_example(key_file)
    if not no_local_stage or key != _key_example(None):
        return key
    url = service.status().http_url
    if url and _refuses_without_key(url):
        return (
            ' -H "Authorization: Bearer <an API key of stage 0>"',
            "'<an API key of stage 0>'",
        )
    return key


def _refuses_without_key(http_url: str, timeout_s: float = 3.0) -> bool:
    """Whether the frontend at ``http_url`` answers 401 to a request without a key."""
    try:
        urllib.request.urlopen(f"{http_url}/v1/models", timeout=timeout_s).close()
    except urllib.error.HTTPError as error:
        return error.code == 401
    except (OSError, ValueError):
        return False
    return False


def _status_command(address: str, args: argparse.Namespace, security: MeshSecurity) -> str:
    """The ``status`` command for this mesh as an operator would paste it: with the
    TLS flags and the join token's file this ``up`` was given (a token from the
    environment is named, never printed)."""
    argv = ["mesh-coordinator", "status", "--coordinator", address, *security.child_argv()]
    note = ""
    if security.join_token:
        token_file = getattr(args, "join_token_file", None)
        if token_file is not None:
            argv += ["--join-token-file", str(Path(token_file).absolute())]
        else:
            note = f"  (with {TOKEN_ENV} set to the join token)"
    return shlex.join(argv) + note


def _announce(
    service: CoordinatorService,
    address: str,
    state_file: Path | None,
    key: tuple[str, str] = ("", "'none'"),
    status_command: str | None = None,
) -> None:
    status = service.status()
    url = status.http_url
    header, api_key = key
    lines = [
        f"Mesh is serving {status.model_id} (term {status.term}) across "
        f"{sum(1 for s in status.stages if s.assigned)} stage(s)."
    ]
    if url:
        lines += [
            f"OpenAI API: {url}/v1",
            "Try it:",
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{header} \\",
            f'    -d \'{{"model": "{status.model_id}", '
            '"messages": [{"role": "user", "content": "Hello!"}]}\'',
            f'  {sys.executable} -c "import os; from openai import OpenAI; '
            f"c = OpenAI(base_url='{url}/v1', api_key={api_key}); "
            f"print(c.chat.completions.create(model='{status.model_id}', "
            "messages=[{'role': 'user', 'content': 'Hello!'}]).choices[0].message.content)\"",
        ]
        lines.append(f"Status page: {url}/status")
    status_command = status_command or f"mesh-coordinator status --coordinator {address}"
    lines.append(f"Topology: {status_command}")
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
    try:
        update_state(
            state_file,
            coordinator=address,
            http_url=url,
            term=status.term,
            model_id=status.model_id,
        )
    except OSError as error:
        logger.error("cannot write the state file %s: %s", state_file, error)


def _terminate(children: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    for child in children:
        if child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def fetch_status(coordinator: str, security: MeshSecurity | None = None) -> StatusReply:
    security = active() if security is None else security
    ch = channel(coordinator, security)
    try:
        reply = coordinator_pb2_grpc.CoordinatorStub(ch).Status(
            StatusRequest().to_proto(), timeout=CONTROL_DEADLINE_S
        )
    except grpc.RpcError as error:
        hint = (
            f"; {unavailable_hint(security, str(error.details()))}"
            if error.code() == grpc.StatusCode.UNAVAILABLE
            else ""
        )
        raise MeshError(
            f"cannot reach the coordinator at {coordinator}: {error.code().name} "
            f"({error.details()}){hint}"
        ) from None
    finally:
        ch.close()
    return StatusReply.from_proto(reply)


def status(args: argparse.Namespace) -> int:
    reply = fetch_status(args.coordinator, validate(security_from_args(args), serving=False))
    view = StatusView(
        coordinator_id=reply.coordinator_id,
        model_id=reply.model_id,
        package_ref=reply.package_ref,
        term=reply.term,
        state=reply.state,
        error=reply.error,
        http_url=reply.http_url,
        layer_count=reply.layer_count,
        stages=tuple(StageStatusView(**vars(s)) for s in reply.stages),
        waiting_for=reply.waiting_for,
    )
    if args.json:
        body = vars(view) | {
            "stages": [
                vars(s)
                | {
                    "layer_range": (
                        [s.layer_range.start, s.layer_range.end] if s.layer_range else None
                    )
                }
                for s in view.stages
            ]
        }
        sys.stdout.write(json.dumps(body, indent=2) + "\n")
    else:
        sys.stdout.write(render_status(view) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "certs":
            sys.stdout.write(run_certs(args) + "\n")
            return 0
        if args.command == "doctor":
            from coordinator.doctor import run_doctor

            return run_doctor(args)
        return up(args) if args.command == "up" else status(args)
    except MeshError as error:
        sys.stderr.write(f"mesh-coordinator: {error.message}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
