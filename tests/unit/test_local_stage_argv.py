"""`mesh-coordinator up` starts its local stages with command lines that the stage CLI
accepts, carrying the engine flags."""

from __future__ import annotations

import pytest

from coordinator.cli import build_parser as coordinator_parser
from coordinator.cli import local_stage_argv
from mesh.security import MeshSecurity
from stage.cli import build_parser as stage_parser


@pytest.mark.parametrize(
    ("flags", "compiled", "graphs"),
    [([], False, False), (["--compile"], True, False), (["--cuda-graphs"], False, True)],
)
def test_engine_flags_reach_the_local_stages(
    flags: list[str], compiled: bool, graphs: bool
) -> None:
    args = coordinator_parser().parse_args(["up", "--device", "cuda:0", *flags])
    argv = local_stage_argv("127.0.0.1:7070", 1, args, 2, False, MeshSecurity())
    assert argv[1:3] == ["-m", "stage.cli"]
    stage = stage_parser().parse_args(argv[3:])
    assert stage.command == "join" and stage.coordinator == "127.0.0.1:7070"
    assert stage.device == "cuda:0" and stage.threads == 2 and stage.node_id == "local-1"
    assert stage.compile is compiled and stage.cuda_graphs is graphs
    assert not stage.frontend


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_row_invariance_reaches_the_local_stages(mode: str) -> None:
    args = coordinator_parser().parse_args(["up", "--row-invariant", mode])
    argv = local_stage_argv("127.0.0.1:7070", 0, args, 1, True, MeshSecurity())
    assert stage_parser().parse_args(argv[3:]).row_invariant == mode


def test_the_api_key_file_reaches_stage_0_and_the_banner_never_prints_the_key(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coordinator.cli import _key_example

    key_file = tmp_path / "api-key"
    key_file.write_text("s3cret-key\n")
    args = coordinator_parser().parse_args(["up", "--api-key-file", str(key_file)])
    stage0 = stage_parser().parse_args(
        local_stage_argv("h:1", 0, args, 1, True, MeshSecurity())[3:]
    )
    assert stage0.api_key_file == key_file.absolute()
    other = local_stage_argv("h:1", 1, args, 1, False, MeshSecurity())
    assert "--api-key-file" not in other
    header, expression = _key_example(args)
    assert f"$(cat {key_file.absolute()})" in header and "s3cret" not in header + expression
    monkeypatch.setenv("MESH_API_KEY", "env-key")
    plain = coordinator_parser().parse_args(["up"])
    assert _key_example(plain) == (
        ' -H "Authorization: Bearer $MESH_API_KEY"',
        "os.environ['MESH_API_KEY']",
    )
    monkeypatch.delenv("MESH_API_KEY")
    assert _key_example(plain) == ("", "'none'")
