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
