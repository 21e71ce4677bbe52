"""The stage processes ``up`` runs on its own host, kept running.

``up`` starts stage 0 (the HTTP API) and ``--spawn-stages`` more stages as child
processes. Before the mesh first serves, a child that exits means a setting or the
model is wrong and would fail again: ``up`` reports it and stops. Once the mesh has
served, a child that exits (a crash, the kernel's OOM killer, a ``kill``) is started
again with the same command, after a delay that doubles while it keeps dying soon
after each start (1 s, 2 s, 4 s, ... up to 30 s; back to 1 s once it stayed up a
minute). The coordinator treats the new process as a stage that joined again: it
plans again and the mesh grows back; for stage 0 that brings the HTTP API back on
its port (the requests it was running when it died are lost: their state lived in
it; clients retry).
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0
# A process that lived this long before it exited counts as having been stable.
STABLE_S = 60.0


@dataclass
class LocalStage:
    index: int
    argv: list[str]
    process: subprocess.Popen
    started: float
    delay_s: float = FIRST_DELAY_S
    # When it is to be started again (None while it runs).
    restart_at: float | None = None
    restarts: int = 0


class LocalStages:
    """Starts the local stage processes and restarts those that exit once the mesh
    has served; ``spawn`` starts one process from its command line."""

    def __init__(
        self,
        spawn: Callable[[list[str]], subprocess.Popen],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._spawn = spawn
        self._clock = clock
        self.stages: list[LocalStage] = []

    def start(self, index: int, argv: list[str]) -> None:
        self.stages.append(LocalStage(index, argv, self._spawn(argv), self._clock()))

    @property
    def processes(self) -> list[subprocess.Popen]:
        """The processes running now."""
        return [s.process for s in self.stages if s.restart_at is None]

    def processes_by_stage0(self) -> tuple[list[subprocess.Popen], list[subprocess.Popen]]:
        """The running processes: stage 0's (a list of at most one), the others'."""
        running = [s for s in self.stages if s.restart_at is None]
        return (
            [s.process for s in running if s.index == 0],
            [s.process for s in running if s.index != 0],
        )

    def check(self, served: bool) -> LocalStage | None:
        """Look at every stage: before the mesh ``served``, the first one that failed
        is returned (``up`` stops); after, those that exited are started again when
        their delay is over."""
        now = self._clock()
        for stage in self.stages:
            if stage.restart_at is not None:
                if now >= stage.restart_at:
                    self._restart(stage, now)
                continue
            code = stage.process.poll()
            if code is None:
                continue
            if not served:
                if code != 0:
                    return stage
                continue
            lived = now - stage.started
            stage.delay_s = FIRST_DELAY_S if lived >= STABLE_S else stage.delay_s
            stage.restart_at = now + stage.delay_s
            logger.warning(
                "local stage %s (process %s) exited with status %s after %.0f s; starting "
                "it again in %.0f s",
                stage.index,
                stage.process.pid,
                code,
                lived,
                stage.delay_s,
            )
            stage.delay_s = min(stage.delay_s * 2.0, MAX_DELAY_S)
        return None

    def _restart(self, stage: LocalStage, now: float) -> None:
        stage.process = self._spawn(stage.argv)
        stage.started = now
        stage.restart_at = None
        stage.restarts += 1
        logger.info(
            "local stage %s started again (process %s, restart %s)",
            stage.index,
            stage.process.pid,
            stage.restarts,
        )
