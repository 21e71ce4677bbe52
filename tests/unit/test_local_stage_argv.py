"""`mesh-coordinator up` starts its local stages with command lines that the stage CLI
accepts, carrying the [stage] settings that apply to them; stage 0's serving and
speculation settings are not flags (they travel with the Load)."""

from __future__ import annotations

import pytest

from coordinator.cli import build_parser as coordinator_parser
from coordinator.cli import local_stage_argv, resolve_up
from mesh.security import MeshSecurity
from stage.cli import build_parser as stage_parser
from stage.cli import resolve_join


def _local(flags: list[str], index: int, frontend: bool):
    config = resolve_up(coordinator_parser().parse_args(["up", *flags]))
    argv = local_stage_argv("127.0.0.1:7070", index, config, 2, frontend, MeshSecurity())
    assert argv[1:4] == ["-P", "-m", "stage.cli"]
    return argv, resolve_join(stage_parser().parse_args(argv[4:]))


@pytest.mark.parametrize(
    ("flags", "compiled", "graphs"),
    [([], False, False), (["--compile"], True, False), (["--cuda-graphs"], False, True)],
)
def test_engine_flags_reach_the_local_stages(
    flags: list[str], compiled: bool, graphs: bool
) -> None:
    _, joined = _local(["--device", "cuda:0", *flags], 1, False)
    stage = joined.stage.value
    assert stage.coordinator == "127.0.0.1:7070"
    assert stage.device == "cuda:0" and stage.threads == 2 and stage.node_id == "local-1"
    assert stage.compile is compiled and stage.cuda_graphs is graphs
    assert not stage.frontend


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_row_invariance_reaches_the_local_stages(mode: str) -> None:
    _, joined = _local(["--row-invariant", mode], 0, True)
    assert joined.stage.value.row_invariant == mode and joined.stage.value.frontend


def test_stage_0_gets_where_to_listen_but_not_its_serving_settings() -> None:
    argv, joined = _local(
        ["--http-port", "8123", "--max-concurrent-requests", "3", "--max-window", "4"], 0, True
    )
    assert joined.frontend.value.http_port == 8123
    # Limits and speculation reach stage 0 with the Load, where its own flags win.
    assert not joined.frontend.given("max_concurrent_requests")
    assert "--max-window" not in argv and "--config" not in argv


def test_the_api_key_file_reaches_stage_0_and_the_banner_never_prints_the_key(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coordinator.cli import _key_example

    key_file = tmp_path / "api-key"
    key_file.write_text("s3cret-key\n")
    _, stage0 = _local(["--api-key-file", str(key_file)], 0, True)
    assert stage0.frontend.value.api_key_file == key_file.absolute()
    other, _ = _local(["--api-key-file", str(key_file)], 1, False)
    assert "--api-key-file" not in other
    header, expression = _key_example(key_file)
    assert f"$(cat {key_file.absolute()})" in header and "s3cret" not in header + expression
    # Several (or named) keys: the file is not the key; the examples say where one is.
    key_file.write_text("alice s3cret-key\nbob other-key\n")
    header, expression = _key_example(key_file)
    assert f"<a key from {key_file.absolute()}>" in header and "$(cat" not in header
    assert "s3cret" not in header + expression and "alice" not in header + expression
    monkeypatch.setenv("MESH_API_KEY", "env-key")
    assert _key_example(None) == (
        ' -H "Authorization: Bearer $MESH_API_KEY"',
        "os.environ['MESH_API_KEY']",
    )
    monkeypatch.delenv("MESH_API_KEY")
    assert _key_example(None) == ("", "'none'")


def test_up_refuses_a_bad_api_key_file_before_starting_anything(
    tmp_path, tiny_package_factory, capsys: pytest.CaptureFixture[str]
) -> None:
    from coordinator.cli import main

    package = tiny_package_factory("llama", layers=2)
    keys = tmp_path / "keys"
    keys.write_text("alice key-1\nbob key-2 max_concurrent=zero\n")
    base = ["up", "--model", str(package), "--listen", "127.0.0.1:0", "--http-port", "0"]
    assert main([*base, "--api-key-file", str(keys)]) == 2
    assert "line 2" in capsys.readouterr().err
    assert main([*base, "--api-key-file", str(tmp_path / "missing")]) == 2
    assert "cannot read the API key file" in capsys.readouterr().err


def test_the_local_stage_0s_ports_can_be_fixed_for_a_firewall(tmp_path, caplog) -> None:
    """Stages on other hosts reach the head's stage 0 (the last stage's return link):
    `up --stage0-port/--stage0-data-port` fix its gRPC and data ports; other local
    stages keep free ports (several share the host)."""
    flags = ["--stage0-port", "7071", "--stage0-data-port", "7072"]
    _, head = _local(flags, 0, True)
    assert head.stage.value.listen.endswith(":7071") and head.stage.value.data_port == 7072
    _, other = _local(flags, 1, False)
    assert other.stage.value.listen.endswith(":0") and other.stage.value.data_port == 0
    _, free = _local([], 0, True)
    assert free.stage.value.listen.endswith(":0") and free.stage.value.data_port == 0
    # [stage] listen / data_port in up's file are join's settings: said, not silent.
    config = tmp_path / "mesh.toml"
    config.write_text('[stage]\nlisten = "0.0.0.0:7071"\ndata_port = 7072\n')
    with caplog.at_level("WARNING"):
        resolve_up(coordinator_parser().parse_args(["up", "--config", str(config)]))
    assert "data_port, listen" in caplog.text and "stage0_port" in caplog.text


def test_up_s_stage_environment_reaches_its_local_stages_only_through_their_flags(
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """MESH_STAGE_* variables of up's environment: the local stages' settings among
    them become flags; the others (join's, such as MESH_STAGE_DATA_PORT, which would
    have every local stage bind one port) are said to be ignored and are not
    inherited."""
    import json
    import sys

    from coordinator.cli import _spawn_stage

    monkeypatch.setenv("MESH_STAGE_DATA_PORT", "7072")
    monkeypatch.setenv("MESH_STAGE_DEVICE", "cuda:1")
    with caplog.at_level("WARNING"):
        config = resolve_up(coordinator_parser().parse_args(["up"]))
    argv = local_stage_argv("127.0.0.1:7070", 1, config, 2, False, MeshSecurity())
    assert "up does not take MESH_STAGE_DATA_PORT" in caplog.text
    assert "MESH_STAGE_DEVICE" not in caplog.text
    seen = tmp_path / "env.json"
    dump = f"import json, os; open({str(seen)!r}, 'w').write(json.dumps(dict(os.environ)))"
    assert _spawn_stage([sys.executable, "-c", dump], MeshSecurity()).wait(60) == 0
    env = json.loads(seen.read_text())
    assert not [k for k in env if k.startswith("MESH_STAGE_")]
    # The local stage, in that environment, from its flags:
    monkeypatch.delenv("MESH_STAGE_DATA_PORT")
    monkeypatch.delenv("MESH_STAGE_DEVICE")
    joined = resolve_join(stage_parser().parse_args(argv[4:])).stage.value
    assert joined.device == "cuda:1" and joined.data_port == 0
