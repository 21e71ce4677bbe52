"""The committed stubs in mesh/proto/v1 match what scripts/gen_proto.py produces."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "gen_proto.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_committed_stubs_are_current() -> None:
    result = _run("--check")
    assert result.returncode == 0, result.stderr


def test_check_detects_a_stale_stub(tmp_path: Path) -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gen_proto
    finally:
        sys.path.remove(str(SCRIPT.parent))
    fresh = gen_proto.generate()
    assert gen_proto.stale_report(fresh, dict(fresh)) == []

    edited = dict(fresh)
    edited["data_pb2.py"] = fresh["data_pb2.py"] + "# hand edit\n"
    missing = {k: v for k, v in fresh.items() if k != "stage_pb2_grpc.py"}
    report = gen_proto.stale_report(fresh, edited) + gen_proto.stale_report(fresh, missing)
    assert any(line.startswith("differs: mesh/proto/v1/data_pb2.py") for line in report)
    assert "missing: mesh/proto/v1/stage_pb2_grpc.py" in report

    gen_proto.write(edited, tmp_path)
    (tmp_path / "old_pb2.py").write_text("# left over\n", encoding="utf-8")
    gen_proto.write(fresh, tmp_path)
    assert gen_proto.current_files(tmp_path) == fresh


def test_generated_imports_use_the_mesh_proto_package() -> None:
    from mesh.proto.v1 import common_pb2, data_pb2, data_pb2_grpc, stage_pb2_grpc

    for path in (REPO_ROOT / "mesh" / "proto" / "v1").glob("*.py*"):
        text = path.read_text(encoding="utf-8")
        assert "from mesh.v1 import" not in text, path.name
    frame = data_pb2.Frame(hidden=common_pb2.Tensor(shape=[2, 3]))
    assert data_pb2.Frame.FromString(frame.SerializeToString()).hidden.shape == [2, 3]
    assert hasattr(data_pb2_grpc, "StageDataServicer")
    assert hasattr(stage_pb2_grpc, "add_StageControlServicer_to_server")
