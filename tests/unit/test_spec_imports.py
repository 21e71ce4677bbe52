"""Import boundaries: speculation is plain torch; the config module is plain Python."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import mesh.config
assert "torch" not in sys.modules, "mesh.config must not import torch"
import mesh.speculative
banned = [m for m in sys.modules if m.split(".")[0] in ("grpc", "fastapi", "stage", "coordinator")]
assert not banned, banned
"""


def test_speculation_imports_no_network_or_server_code() -> None:
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
