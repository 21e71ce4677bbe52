"""The coordinator's state file: the serving record and the highest term used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from coordinator.state_file import record_term, term_floor, update_state
from mesh.lifetime import PARENT_PID_ENV


def test_terms_recorded_survive_and_never_go_down(tmp_path) -> None:
    path = tmp_path / "state.json"
    assert term_floor(path) == 0
    record_term(path, 4)
    update_state(path, term=4, http_url="http://h:8000")
    record_term(path, 6)
    record_term(path, 5)  # an older term never lowers the floor
    body = json.loads(path.read_text())
    assert body == {"max_term": 6, "term": 4, "http_url": "http://h:8000"}
    assert term_floor(path) == 6


def test_an_unreadable_state_file_is_ignored(tmp_path) -> None:
    path = tmp_path / "state.json"
    path.write_text("{not json")
    assert term_floor(path) == 0
    record_term(path, 2)
    assert term_floor(path) == 2
    assert term_floor(None) == 0


def test_a_watched_child_stops_when_its_parent_dies(tmp_path) -> None:
    """A middle process starts a child that watches it, then dies by SIGKILL; the
    child notices and exits by itself."""
    marker = tmp_path / "child-stopped"
    child = textwrap.dedent(
        f"""
        import threading, pathlib
        from mesh.lifetime import watch_parent
        gone = threading.Event()
        assert watch_parent(gone.set, poll_s=0.05)
        assert gone.wait(30)
        pathlib.Path({str(marker)!r}).write_text("stopped")
        """
    )
    middle = textwrap.dedent(
        f"""
        import os, signal, subprocess, sys
        env = dict(os.environ, {PARENT_PID_ENV}=str(os.getpid()))
        subprocess.Popen([sys.executable, "-c", {child!r}], env=env)
        import time; time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != PARENT_PID_ENV}
    subprocess.run([sys.executable, "-c", middle], env=env, timeout=60, check=False)
    import time

    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.read_text() == "stopped"


def test_nothing_is_watched_without_the_variable(monkeypatch) -> None:
    from mesh.lifetime import watch_parent

    monkeypatch.delenv(PARENT_PID_ENV, raising=False)
    assert watch_parent(lambda: None) is False
