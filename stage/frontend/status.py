"""What the status page reports that only stage 0 sees: the pipeline's recent work
(each stage's compute and queue time per frame, from the timings every answer
carries; the round time of a frame; the tokens committed) and a short log of what
happened (loads, reloads, lost stages, warnings).

No network and no metrics registry: the scheduler feeds ``PipelineActivity`` the
answers it receives, the status page (stage/frontend/status_page.py) feeds
``EventLog`` and reads both.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from mesh.codec import StatusReply
from mesh.frames import FrameResult
from stage.frontend.engine_types import Outcome, SentFrame

# Tokens per second are counted over this many seconds.
WINDOW_S = 10.0
# A stage's step and queue times are means over its last frames.
TIMING_FRAMES = 64
EVENT_LIMIT = 50


@dataclass(frozen=True)
class StageTimes:
    """Means over a stage's last ``frames`` frames, in milliseconds."""

    stage_index: int
    step_ms: float
    queue_ms: float
    frames: int


@dataclass(frozen=True)
class ActivitySnapshot:
    """``PipelineActivity`` at one moment; ``stages`` are of frames of ``term``."""

    term: int
    tokens_per_s: float
    tokens_total: int
    window_s: float
    round_ms: float | None
    stages: dict[int, StageTimes]


class PipelineActivity:
    """Recent work of the pipeline as the answers to stage 0's frames show it.

    Timings belong to the term of the frames they came with: a new term (another
    pipeline, perhaps other nodes at each index) starts them afresh. Called on the
    scheduler's event loop only."""

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        window_s: float = WINDOW_S,
        frames: int = TIMING_FRAMES,
    ) -> None:
        self.clock = clock
        self.window_s = window_s
        self.frames = frames
        self.term = 0
        self.tokens_total = 0
        self._tokens: deque[tuple[float, int]] = deque()
        self._stages: dict[int, deque[tuple[float, float]]] = {}
        self._rounds: deque[float] = deque(maxlen=frames)

    def observe(
        self, result: FrameResult, sent: SentFrame | None, outcomes: Iterable[Outcome]
    ) -> None:
        """One answer: the frame it answers (None when stage 0 no longer waits for it)
        and the events it produced."""
        now = self.clock()
        tokens = sum(len(o.event.token_ids) for o in outcomes if o.event is not None)
        if tokens:
            self.tokens_total += tokens
            self._tokens.append((now, tokens))
        if sent is None or sent.term != result.term or not result.timings:
            return
        if result.term != self.term:
            self.term = result.term
            self._stages.clear()
            self._rounds.clear()
        self._rounds.append((now - sent.sent_at) * 1000.0)
        for timing in result.timings:
            times = self._stages.setdefault(timing.stage_index, deque(maxlen=self.frames))
            times.append((timing.compute_ms, timing.queue_ms))

    def tokens_per_s(self) -> float:
        """Tokens committed in the last ``window_s`` seconds, per second."""
        edge = self.clock() - self.window_s
        while self._tokens and self._tokens[0][0] < edge:
            self._tokens.popleft()
        return sum(count for _, count in self._tokens) / self.window_s

    def round_ms(self) -> float | None:
        """Mean time from sending a frame to its answer, over the last frames."""
        return sum(self._rounds) / len(self._rounds) if self._rounds else None

    def snapshot(self) -> ActivitySnapshot:
        return ActivitySnapshot(
            term=self.term,
            tokens_per_s=self.tokens_per_s(),
            tokens_total=self.tokens_total,
            window_s=self.window_s,
            round_ms=self.round_ms(),
            stages=self.stage_times(),
        )

    def stage_times(self) -> dict[int, StageTimes]:
        return {
            index: StageTimes(
                index,
                sum(step for step, _ in times) / len(times),
                sum(queue for _, queue in times) / len(times),
                len(times),
            )
            for index, times in self._stages.items()
            if times
        }


@dataclass(frozen=True)
class StatusEvent:
    """``time``: Unix seconds of the latest occurrence; ``count``: occurrences of
    the same event in a row (one line for a warning logged per request)."""

    time: float
    kind: str
    message: str
    count: int = 1


class EventLog:
    """The last ``limit`` events, newest first. An event added under the ``key`` of
    the newest one replaces it (its message and time) and counts up."""

    def __init__(self, limit: int = EVENT_LIMIT, clock: Callable[[], float] = time.time) -> None:
        self.limit = limit
        self.clock = clock
        self._lock = threading.Lock()
        self._events: deque[tuple[Hashable, StatusEvent]] = deque(maxlen=limit)

    def add(self, kind: str, message: str, key: Hashable | None = None) -> None:
        key = (kind, message) if key is None else key
        with self._lock:
            count = 1
            if self._events and self._events[-1][0] == key:
                count += self._events.pop()[1].count
            self._events.append((key, StatusEvent(self.clock(), kind, message, count)))

    def events(self) -> list[StatusEvent]:
        with self._lock:
            return [event for _, event in reversed(self._events)]


class WarningEvents(logging.Handler):
    """Puts this process's warnings and errors into an ``EventLog``, keyed by their
    message template (a warning logged for each of several requests in a row shows
    once, counted)."""

    def __init__(self, log: EventLog) -> None:
        super().__init__(logging.WARNING)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad log call must not break the caller
            message = str(record.msg)
        kind = "error" if record.levelno >= logging.ERROR else "warning"
        self.log.add(kind, message, key=(kind, record.name, str(record.msg)))


def coordinator_changes(before: StatusReply | None, after: StatusReply) -> list[tuple[str, str]]:
    """``(kind, message)`` for what changed between two coordinator answers: a node
    that died (a failover when it held a stage), came back or joined, the mesh's
    state, a new error."""
    changes: list[tuple[str, str]] = []
    known = {stage.node_id: stage for stage in before.stages} if before is not None else {}
    for node in after.stages:
        old = known.get(node.node_id)
        if old is None:
            if before is not None:
                changes.append(("node", f"node {node.node_id} joined from {node.address}"))
            continue
        if old.health == "alive" and node.health == "dead":
            held = f"stage {old.stage_index}, layers {old.layer_range}" if old.assigned else ""
            changes.append(
                (
                    "failover" if old.assigned else "node",
                    f"node {node.node_id} ({node.address}) missed its heartbeats"
                    + (f"; it held {held}" if held else ""),
                )
            )
        elif old.health == "alive" and node.health == "stalled":
            held = f"stage {old.stage_index}, layers {old.layer_range}" if old.assigned else ""
            changes.append(
                (
                    "failover" if old.assigned else "node",
                    f"node {node.node_id} ({node.address}) stopped passing frames on"
                    + (f"; it held {held}" if held else "")
                    + " (left out of plans for a while)",
                )
            )
        elif old.health in ("dead", "stalled") and node.health == "alive":
            changes.append(("node", f"node {node.node_id} ({node.address}) is back"))
    if before is not None and before.state != after.state:
        changes.append(("mesh", f"mesh state {before.state} -> {after.state}"))
    if after.error and (before is None or before.error != after.error):
        changes.append(("error", after.error))
    return changes
