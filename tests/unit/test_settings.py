"""The configuration tree: one name per setting (flag = TOML key = field = environment
variable), CLI > environment > TOML > built-in with every value's source, errors that
name the key and its source, and stage 0's serving settings merged from the Load."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from coordinator.cli import build_parser as coordinator_parser
from coordinator.cli import resolve_up
from mesh.config import resolve_speculation, speculation_layers
from mesh.errors import InvalidRequest
from mesh.settings import SECTIONS, FrontendConfig, StageConfig, add_arguments, resolve
from mesh.settings.commands import merge_serving, sent_speculation, serving_settings
from mesh.settings.tree import env_name, flag
from stage.cli import build_parser as stage_parser
from stage.cli import resolve_join
from stage.frontend.engine_types import EngineLimits


def _options(parser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


@pytest.mark.parametrize(("section", "cls"), list(SECTIONS.items()))
def test_every_setting_has_one_name(section: str, cls: type) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser, cls)
    for field in dataclasses.fields(cls):
        assert flag(field.name) in _options(parser)
        # The TOML key and the environment variable are the field's name too.
        toml = {section: {field.name: field.default}} if field.default is not None else {}
        resolved = resolve(cls, section, {}, toml, env={})
        assert getattr(resolved.value, field.name) == field.default
        assert env_name(section, field.name) == f"MESH_{section}_{field.name}".upper()


def test_the_commands_take_their_sections_flags() -> None:
    join = stage_parser()._subparsers._group_actions[0].choices["join"]
    for cls in (StageConfig, FrontendConfig):
        assert {flag(f.name) for f in dataclasses.fields(cls)} <= _options(join)
    up = coordinator_parser()._subparsers._group_actions[0].choices["up"]
    assert {flag(f.name) for f in dataclasses.fields(FrontendConfig)} <= _options(up)


def test_cli_beats_environment_beats_toml_beats_built_in(tmp_path: Path) -> None:
    toml = {"stage": {"threads": 3, "device": "cuda:1", "speed": 2.0}}
    env = {"MESH_STAGE_DEVICE": "cuda:2", "MESH_STAGE_SPEED": "4"}
    resolved = resolve(StageConfig, "stage", {"speed": 8.0}, toml, env, toml_source="m.toml")
    stage = resolved.value
    assert (stage.threads, stage.device, stage.speed, stage.row_invariant) == (
        3,
        "cuda:2",
        8.0,
        "auto",
    )
    assert resolved.origin("threads") == "m.toml [stage] threads"
    assert resolved.origin("device") == "environment MESH_STAGE_DEVICE"
    assert resolved.origin("speed") == "CLI --speed"
    assert resolved.origin("row_invariant") == "built-in default"
    assert not resolved.given("row_invariant") and resolved.given("threads")


def test_text_values_are_parsed_with_the_fields_rules() -> None:
    env = {"MESH_STAGE_MEMORY": "2GiB", "MESH_STAGE_COMPILE": "yes"}
    stage = resolve(StageConfig, "stage", {}, {}, env).value
    assert stage.memory == 2 * 2**30 and stage.compile is True
    cli = stage_parser().parse_args(["join", "--memory", "512MB", "--no-compile"])
    stage = resolve_join(cli).stage.value
    assert stage.memory == 512 * 10**6 and stage.compile is False


@pytest.mark.parametrize(
    ("toml", "env", "message"),
    [
        ({"frontend": {"max_queued": -1}}, {}, "frontend.max_queued from m.toml [frontend]"),
        ({"frontend": {"http_port": "80"}}, {}, "expected a number"),
        ({"stage": {"row_invariant": "maybe"}}, {}, "is not one of auto, on, off"),
        ({"stage": {"threads": 1.5}}, {}, "expected a whole number"),
        ({"stage": {"thread": 2}}, {}, "unknown key(s) thread in [stage]"),
        ({"stage": []}, {}, "[stage] must be a table"),
        ({}, {"MESH_STAGE_THREADS": "two"}, "stage.threads from environment MESH_STAGE_THREADS"),
        ({}, {"MESH_STAGE_MEMORY": "lots"}, "stage.memory from environment MESH_STAGE_MEMORY"),
        ({}, {"MESH_STAGE_COMPILE": "sometimes"}, "is not a boolean"),
    ],
)
def test_bad_values_name_the_key_and_its_source(toml: dict, env: dict, message: str) -> None:
    section = next(iter(toml), "stage")
    cls = SECTIONS[section]
    with pytest.raises(InvalidRequest) as error:
        resolve(cls, section, {}, toml, env, toml_source="m.toml")
    assert message in error.value.message


def test_a_config_file_is_checked_whole_when_a_command_starts(tmp_path: Path) -> None:
    path = tmp_path / "mesh.toml"
    path.write_text("[frontend]\nmax_concurrent_requests = 4\n[stage]\nthreds = 2\n")
    args = stage_parser().parse_args(["join", "--config", str(path)])
    with pytest.raises(InvalidRequest, match=r"unknown key\(s\) threds in \[stage\]"):
        resolve_join(args)
    path.write_text("[frontend]\nmax_concurrent_requests = 4\n[frontned]\n")
    with pytest.raises(InvalidRequest, match="unknown table"):
        resolve_up(coordinator_parser().parse_args(["up", "--config", str(path)]))
    path.write_text('[frontend]\nmax_concurrent_requests = 4\n[coordinator]\nwire_dtype = "bf16"\n')
    config = resolve_up(coordinator_parser().parse_args(["up", "--config", str(path)]))
    assert config.frontend.value.max_concurrent_requests == 4
    assert config.coordinator.value.wire_dtype == "bf16"
    assert config.frontend.origin("max_concurrent_requests") == f"{path} [frontend] " + (
        "max_concurrent_requests"
    )


def test_max_sessions_is_refused_with_the_names_that_replace_it(capsys) -> None:
    for parser, command in ((coordinator_parser(), "up"), (stage_parser(), "join")):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--max-sessions", "8"])
        err = capsys.readouterr().err
        assert "--max-concurrent-requests" in err and "--kv-max-sessions" in err


def test_kv_sessions_follow_the_request_limit_unless_set() -> None:
    from mesh.settings import kv_sessions

    config = resolve_up(coordinator_parser().parse_args(["up", "--max-concurrent-requests", "5"]))
    assert kv_sessions(config.coordinator.value, config.frontend.value) == 5
    config = resolve_up(coordinator_parser().parse_args(["up", "--kv-max-sessions", "9"]))
    assert kv_sessions(config.coordinator.value, config.frontend.value) == 9


def test_stage_0_takes_the_coordinators_serving_settings_unless_given_its_own() -> None:
    up = resolve_up(
        coordinator_parser().parse_args(
            ["up", "--max-concurrent-requests", "3", "--max-queued", "7", "--max-window", "6"]
        )
    )
    speculation = speculation_layers({"max_window": 6}, {}, "m")
    sent = serving_settings(up.frontend, speculation)
    own = resolve_join(stage_parser().parse_args(["join", "--frontend", "--max-queued", "1"]))
    merged = merge_serving(own.frontend, sent)
    assert merged.value.max_concurrent_requests == 3
    assert merged.origin("max_concurrent_requests") == (
        "coordinator: CLI --max-concurrent-requests"
    )
    assert merged.value.max_queued == 1 and merged.origin("max_queued") == "CLI --max-queued"
    assert merged.value.prefix_cache_tokens == FrontendConfig.prefix_cache_tokens
    limits = EngineLimits.of(merged.value)
    assert (limits.max_sessions, limits.max_queued) == (3, 1)
    # Speculation: the coordinator's sources sit below stage 0's own.
    layers = sent_speculation(sent)
    config = resolve_speculation({}, {}, "m", None, lower=layers)
    assert config.window_policy.max_window == 6
    assert config.origin("window_policy.max_window") == "coordinator: CLI"
    config = resolve_speculation({"max_window": 5}, {}, "m", None, lower=layers)
    assert config.window_policy.max_window == 5


def test_a_bad_value_sent_by_a_coordinator_names_it() -> None:
    own = resolve_join(stage_parser().parse_args(["join", "--frontend"]))
    bad = (("frontend.max_queued", json.dumps(-3), "CLI --max-queued"),)
    with pytest.raises(InvalidRequest, match="coordinator: CLI --max-queued"):
        merge_serving(own.frontend, bad)
    with pytest.raises(InvalidRequest, match="coordinator: CLI"):
        resolve_speculation(
            {}, {}, "m", None, lower=[("coordinator: CLI", {"window_policy.max_window": 999})]
        )


def test_print_config_shows_every_value_and_its_source(tmp_path: Path) -> None:
    path = tmp_path / "mesh.toml"
    path.write_text('[stage]\nthreads = 2\n[security]\ntls_ca = "ca.pem"\n')
    secret = "a-secret-join-token-0123456789"
    done = subprocess.run(
        [sys.executable, "-m", "stage.cli", "join", "--config", str(path), "--print-config"]
        + ["--http-port", "9001", "--tls-mutual"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"MESH_STAGE_DEVICE": "cuda:3", "PATH": "/usr/bin:/bin", "MESH_JOIN_TOKEN": secret},
    )
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines()}
    assert lines["stage.threads"].endswith(f"({path} [stage] threads)")
    assert '"cuda:3"' in lines["stage.device"] and "MESH_STAGE_DEVICE" in lines["stage.device"]
    assert "(CLI --http-port)" in lines["frontend.http_port"]
    assert "(built-in default)" in lines["frontend.max_queued"]
    # [security] too: where each value comes from, and never the token itself.
    assert secret not in done.stdout
    assert "environment MESH_JOIN_TOKEN" in lines["security.join_token"]
    assert (
        str(tmp_path / "ca.pem") in lines["security.tls_ca"]
        and str(path) in lines["security.tls_ca"]
    )
    assert "true" in lines["security.tls_mutual"] and "--tls-mutual" in lines["security.tls_mutual"]
    assert "built-in default" in lines["security.tls_cert"]


def test_an_unknown_variable_of_a_section_is_said_with_the_closest_name(caplog) -> None:
    """A typo in a MESH_<SECTION>_* variable is logged (the same typo in TOML is an
    error); a known one and other sections' variables are not."""
    env = {"MESH_STAGE_THREDS": "2", "MESH_STAGE_THREADS": "1", "MESH_JOIN_TOKEN": "x"}
    with caplog.at_level("WARNING"):
        resolved = resolve(StageConfig, "stage", env=env)
    assert resolved.value.threads == 1
    assert "MESH_STAGE_THREDS is not a [stage] setting" in caplog.text
    assert "did you mean MESH_STAGE_THREADS?" in caplog.text
    assert "MESH_JOIN_TOKEN" not in caplog.text


def test_up_print_config_builds_nothing(tmp_path: Path) -> None:
    """``up --print-config`` with the default model and no package built yet prints
    and exits at once: it does not build the default package (a dry run)."""
    home = tmp_path / "home"
    done = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "up", "--print-config", "--spec-type", "ngram"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"MESH_HOME": str(home), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert not home.exists() or not any(home.rglob("*.safetensors"))
    assert "building the default package" not in done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines()}
    assert '"default"' in lines["coordinator.model"]
    assert "(built-in default)" in lines["frontend.max_queued"]
    assert "CLI" in lines["speculation.type"] and '"ngram"' in lines["speculation.type"]
    assert "no token" in lines["security.join_token"]


def test_the_start_up_banner_s_status_command_carries_the_security_flags(tmp_path: Path) -> None:
    """``up`` prints a ``status`` command to paste: on a secured mesh it names the TLS
    files and the join token's file (a token from the environment is named, never
    printed), so that it works as printed."""
    import argparse

    from coordinator.cli import _status_command
    from mesh.security import MeshSecurity

    plain = _status_command("10.0.0.1:7070", argparse.Namespace(), MeshSecurity())
    assert plain == "mesh-coordinator status --coordinator 10.0.0.1:7070"
    certs = {name: tmp_path / f"{name}.pem" for name in ("cert", "key", "ca")}
    secured = MeshSecurity(
        join_token="s3cret-token-value",
        tls_cert=certs["cert"],
        tls_key=certs["key"],
        tls_ca=certs["ca"],
        tls_mutual=True,
    )
    given = argparse.Namespace(join_token_file=tmp_path / "token")
    command = _status_command("10.0.0.1:7070", given, secured)
    assert f"--tls-ca {certs['ca']}" in command and "--tls-mutual" in command
    assert f"--join-token-file {tmp_path / 'token'}" in command
    from_env = _status_command("10.0.0.1:7070", argparse.Namespace(), secured)
    assert "MESH_JOIN_TOKEN" in from_env and "s3cret" not in from_env


def test_the_banner_of_an_up_without_local_stage_asks_for_stage_0_s_key(monkeypatch) -> None:
    """With ``--no-local-stage`` up does not hold stage 0's keys: when the frontend
    refuses a request without one, the banner's examples say where its key goes."""
    monkeypatch.delenv("MESH_API_KEY", raising=False)
    import http.server
    from types import SimpleNamespace

    from coordinator.cli import _banner_key

    class Frontend(http.server.BaseHTTPRequestHandler):
        code = 401

        def do_GET(self) -> None:  # noqa: N802 (the handler's name)
            self.send_response(self.code)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Frontend)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        service = SimpleNamespace(status=lambda: SimpleNamespace(http_url=url))
        header, expression = _banner_key(service, True, None)
        assert "<an API key of stage 0>" in header and "<an API key of stage 0>" in expression
        # A local stage 0 (its key file is up's own) is never probed.
        assert _banner_key(service, False, None) == ("", "'none'")
        Frontend.code = 200
        assert _banner_key(service, True, None) == ("", "'none'")
    finally:
        server.shutdown()
    unreachable = SimpleNamespace(status=lambda: SimpleNamespace(http_url=url))
    assert _banner_key(unreachable, True, None) == ("", "'none'")
