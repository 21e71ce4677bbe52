"""``up``'s local stage processes (coordinator/local_stages.py): a failure before the
mesh first serves is reported, one after it is started again after a delay that
doubles while the process keeps dying soon after each start."""

from __future__ import annotations

import subprocess
import sys

from coordinator.local_stages import FIRST_DELAY_S, MAX_DELAY_S, STABLE_S, LocalStages


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def exits_with(code: int) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.exit({code})"]


def spawner(log: list[list[str]]):
    def spawn(argv: list[str]) -> subprocess.Popen:
        log.append(argv)
        process = subprocess.Popen(argv)
        process.wait(30)
        return process

    return spawn


def test_a_stage_that_fails_before_the_mesh_served_is_reported_not_restarted() -> None:
    started: list[list[str]] = []
    stages = LocalStages(spawner(started), Clock())
    stages.start(0, exits_with(0))
    stages.start(1, exits_with(3))
    failed = stages.check(served=False)
    assert failed is not None and failed.index == 1 and failed.process.returncode == 3
    assert len(started) == 2


def test_after_the_mesh_served_an_exited_stage_is_started_again_with_backoff() -> None:
    clock = Clock()
    started: list[list[str]] = []
    stages = LocalStages(spawner(started), clock)
    stages.start(0, exits_with(1))
    delays = []
    for _ in range(8):
        assert stages.check(served=True) is None  # it exited: a restart is scheduled
        (stage,) = stages.stages
        assert stages.processes == []
        delays.append(stage.restart_at - clock.now)
        clock.now = stage.restart_at - 0.01
        stages.check(served=True)
        assert stage.restart_at is not None  # not before its delay
        clock.now = stage.restart_at
        stages.check(served=True)  # started again
        assert stage.restart_at is None and stages.processes == [stage.process]
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert delays[0] == FIRST_DELAY_S and max(delays) == MAX_DELAY_S
    assert len(started) == 9 and all(argv == started[0] for argv in started)
    # A process that stayed up a while starts again after the first delay.
    clock.now += STABLE_S
    stages.check(served=True)
    assert stages.stages[0].restart_at - clock.now == FIRST_DELAY_S


def test_a_running_stage_is_left_alone() -> None:
    started: list[list[str]] = []

    def spawn(argv: list[str]) -> subprocess.Popen:
        started.append(argv)
        return subprocess.Popen(argv)

    stages = LocalStages(spawn, Clock())
    stages.start(0, [sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert stages.check(served=True) is None and stages.check(served=False) is None
        assert len(stages.processes) == 1 and len(started) == 1
    finally:
        for process in stages.processes:
            process.kill()
            process.wait()
