"""Fault injection against a real local mesh, and the checker that judges every
stream against its no-fault output.

A round starts a few concurrent streams (greedy and seeded sampling), waits until
each has produced tokens, injects one fault into the mesh, waits for the streams to
end and classifies each one:

- ``identical``: it completed and its text equals the no-fault text;
- ``failed``: it ended with an explicit error (an HTTP error or an error event);
- ``corrupted``: it completed without an error but its text differs. This must
  never happen: a fault may cost a request, never its correctness.

Faults: ``kill`` (SIGKILL a non-zero stage; it is started again after the round),
``stop`` (SIGSTOP a non-zero stage for 1-15 s, then SIGCONT), ``throttle`` (a slow
stage: stopped and continued on a duty cycle for a few seconds), ``coordinator``
(SIGKILL the coordinator, start a new one on the same address with the same state
file), ``pause`` (SIGSTOP the coordinator for 1-12 s, then SIGCONT: a paused VM or
a starved host; nothing should fail over), ``reset`` (the TCP connections between a
non-zero stage and the other stages reset while every process stays up: loopback
meshes), ``hang`` (the threads that read and process a non-zero stage's frames
frozen for 2-30 s while the process and its heartbeats run on: a hung device call
or lock, ``coordinator/thread_freeze.py``; the round's streams start once they are
frozen, so that every one meets the hang) and, on network-namespace hosts, ``link``
(the link of a non-zero stage's host down for 1-10 s, then up).
After each round the mesh is brought back to its full size before the next. Used by
``tests/integration/test_chaos.py`` and ``benchmarks/chaos.py``.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from coordinator.localmesh import MeshProcesses, wait_for

logger = logging.getLogger(__name__)

FAULT_KINDS = ("kill", "stop", "throttle", "coordinator", "reset", "link", "hang", "pause")
# The threads a ``hang`` freezes: a stage's frame readers and its frame worker (on
# stage 0 the readers of answers only: its own compute stuck is not planned around).
HANG_THREADS = ("data-reader", "stage-worker")
HANG_THREADS_STAGE0 = ("data-reader",)
# Link faults need hosts made of network namespaces (MeshProcesses(hosts=...)); reset
# faults a loopback mesh (one network namespace: both ends of a connection visible).
LOOPBACK_FAULT_KINDS = tuple(k for k in FAULT_KINDS if k != "link")
NETNS_FAULT_KINDS = tuple(k for k in FAULT_KINDS if k != "reset")
OUTCOMES = ("identical", "failed", "corrupted")


@dataclass(frozen=True)
class StreamSpec:
    """One request: a completion of ``prompt``, or a chat of ``messages`` when set,
    or the embeddings of ``inputs`` when set; greedy when temperature is 0, else
    seeded sampling."""

    prompt: str
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    messages: tuple[dict[str, str], ...] = ()
    inputs: tuple[str, ...] = ()
    # More request fields (``n``, ``logprobs``, ``tools``, ``response_format``,
    # ``prediction``, ``stop``...) as JSON text by name, with a label for the tables.
    extra: tuple[tuple[str, str], ...] = ()
    feature: str = ""


@dataclass(frozen=True)
class StreamOutcome:
    text: str
    finish_reason: str | None
    error: str | None = None
    # An embeddings request's vectors.
    vectors: tuple[tuple[float, ...], ...] = ()
    # A request with ``logprobs``: every streamed token's log-probability, in order
    # (the tokens themselves are part of ``text``).
    logprobs: tuple[float, ...] = ()


# The largest difference between an embedding under a fault and without one that
# counts as the same: a prompt read again after a failover may be summed in other
# chunks (float32 rounding), never more.
EMBEDDING_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Fault:
    kind: str
    target: str = ""  # node id; empty for the coordinator
    duration_s: float = 0.0


@dataclass
class RoundRecord:
    fault: Fault
    outcomes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    failover: bool = False
    # Seconds from the fault until the mesh served again (None: it never stopped).
    recovery_s: float | None = None
    # What each stream of the round was (``request_kind``), in outcome order.
    requests: list[str] = field(default_factory=list)


def request_kind(spec: StreamSpec) -> str:
    """``embeddings``, ``chat`` or ``completion``, and the feature a chat request
    exercises (``chat+tools``...)."""
    if spec.inputs:
        return "embeddings"
    kind = "chat" if spec.messages else "completion"
    return f"{kind}+{spec.feature}" if spec.feature else kind


TOPICS = ["rivers", "prime numbers", "bread", "the moon", "chess", "glaciers", "owls"]


def default_specs(count: int, max_tokens: int, rng: random.Random) -> list[StreamSpec]:
    """``count`` varied requests, half greedy, half seeded sampling."""
    specs = []
    for index in range(count):
        topic = rng.choice(TOPICS)
        prompt = f"Note {index}: write a few sentences about {topic}, then list three facts."
        if index % 2:
            specs.append(StreamSpec(prompt, max_tokens, 0.8, seed=rng.randrange(1 << 31)))
        else:
            specs.append(StreamSpec(prompt, max_tokens))
    return specs


_TOOL = {
    "type": "function",
    "function": {
        "name": "count_things",
        "description": "Count something about a subject.",
        "parameters": {
            "type": "object",
            # Short values: the call ends within a few dozen tokens on any model.
            "properties": {
                "subject": {"type": "string", "maxLength": 12},
                "count": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["subject", "count"],
            "additionalProperties": False,
        },
    },
}
_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "facts",
        "schema": {
            "type": "object",
            "properties": {
                "topic": {"type": "string", "maxLength": 24},
                "facts": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 40},
                    "maxItems": 3,
                },
            },
            "required": ["topic", "facts"],
            "additionalProperties": False,
        },
    },
}


def feature_specs(max_tokens: int, rng: random.Random) -> list[StreamSpec]:
    """Chat requests that take the frontend's other paths through a fault: ``n``
    choices, log-probabilities, a forced tool call (a grammar on the last stage),
    a JSON schema, Predicted Outputs (right and wrong), stop strings."""
    ask = ({"role": "user", "content": f"Tell me about {rng.choice(TOPICS)}."},)
    text = " ".join(f"{rng.choice(TOPICS)} {rng.randrange(100)}" for _ in range(24))
    copy = ({"role": "user", "content": f"Repeat this text exactly, nothing else: {text}"},)
    seed = rng.randrange(1 << 31)

    def spec(
        feature: str, messages: tuple, temperature: float = 0.0, tokens: int = 0, **fields: Any
    ) -> StreamSpec:
        extra = tuple((k, json.dumps(v)) for k, v in sorted(fields.items()))
        return StreamSpec(
            "",
            tokens or max_tokens,
            temperature,
            seed if temperature else None,
            messages,
            extra=extra,
            feature=feature,
        )

    return [
        spec("n", ask, 0.8, n=2),
        spec("logprobs", ask, logprobs=True, top_logprobs=3),
        spec(
            "tools",
            ask,
            tokens=256,
            tools=[_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
        ),
        spec("schema", ask, 0.8, tokens=256, response_format=_SCHEMA),
        spec("prediction", copy, prediction={"type": "content", "content": text}),
        spec("prediction", ask, prediction={"type": "content", "content": text}),
        spec("stop", ask, 0.8, stop=[".", "\n\n"]),
    ]


def embedding_specs(count: int, inputs: int, rng: random.Random) -> list[StreamSpec]:
    """``count`` embeddings requests of ``inputs`` texts each, long enough to take a
    while (and to be read in several chunks)."""
    specs = []
    for index in range(count):
        texts = tuple(
            f"Document {index}.{n}: "
            + " ".join(f"{rng.choice(TOPICS)} {rng.randrange(1000)}" for _ in range(60))
            for n in range(inputs)
        )
        specs.append(StreamSpec("", 0, inputs=texts))
    return specs


def run_stream(
    base_url: str, model: str, spec: StreamSpec, started: threading.Event | None = None
) -> StreamOutcome:
    """Stream one completion with the openai client; errors become an outcome."""
    from openai import OpenAI, OpenAIError

    client = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    pieces: list[str] = []
    finish: str | None = None
    params = dict(
        model=model,
        max_tokens=spec.max_tokens,
        temperature=spec.temperature,
        seed=spec.seed,
        stream=True,
    )
    if spec.extra:
        return _run_featured(client, params, spec, started)
    try:
        if spec.inputs:
            if started is not None:
                started.set()  # one answer, nothing streamed: the fault comes while it runs
            reply = client.embeddings.create(
                model=model, input=list(spec.inputs), encoding_format="float"
            )
            vectors = tuple(tuple(item.embedding) for item in reply.data)
            return StreamOutcome("", "embeddings", vectors=vectors)
        if spec.messages:
            stream = client.chat.completions.create(messages=list(spec.messages), **params)
        else:
            stream = client.completions.create(prompt=spec.prompt, **params)
        for chunk in stream:
            for choice in chunk.choices:
                text = choice.delta.content if spec.messages else choice.text
                pieces.append(text or "")
                finish = choice.finish_reason or finish
            if started is not None and len(pieces) >= 2:
                started.set()
    except OpenAIError as error:
        return StreamOutcome("".join(pieces), finish, f"{type(error).__name__}: {error}")
    finally:
        if started is not None:
            started.set()
    return StreamOutcome("".join(pieces), finish)


def _run_featured(
    client: Any, params: dict[str, Any], spec: StreamSpec, started: threading.Event | None
) -> StreamOutcome:
    """A chat request with ``spec.extra``'s fields, streamed; its outcome's text holds
    every choice's content, tool calls, finish reason and log-probability tokens (as
    JSON), so a choice that changes under a fault is seen whichever part changed."""
    from openai import OpenAIError

    choices: dict[int, dict[str, Any]] = {}
    values: list[float] = []
    chunks = 0

    def state(index: int) -> dict[str, Any]:
        return choices.setdefault(index, {"content": "", "calls": {}, "tokens": [], "finish": None})

    def outcome(error: str | None = None) -> StreamOutcome:
        text = json.dumps([choices[i] for i in sorted(choices)], sort_keys=True)
        finishes = {c["finish"] for c in choices.values()}
        finish = finishes.pop() if len(finishes) == 1 else ",".join(sorted(map(str, finishes)))
        return StreamOutcome(text, finish, error, logprobs=tuple(values))

    extra = {key: json.loads(value) for key, value in spec.extra}
    try:
        stream = client.chat.completions.create(
            messages=list(spec.messages), extra_body=extra, **params
        )
        for chunk in stream:
            for choice in chunk.choices:
                entry = state(choice.index)
                entry["content"] += choice.delta.content or ""
                for call in choice.delta.tool_calls or ():
                    slot = entry["calls"].setdefault(str(call.index), {"name": "", "args": ""})
                    if call.function is not None:
                        slot["name"] += call.function.name or ""
                        slot["args"] += call.function.arguments or ""
                for item in (choice.logprobs.content or ()) if choice.logprobs else ():
                    entry["tokens"].append([item.token, [t.token for t in item.top_logprobs]])
                    values.append(item.logprob)
                    values.extend(t.logprob for t in item.top_logprobs)
                entry["finish"] = choice.finish_reason or entry["finish"]
            chunks += 1
            if started is not None and chunks >= 2:
                started.set()
    except OpenAIError as error:
        return outcome(f"{type(error).__name__}: {error}")
    finally:
        if started is not None:
            started.set()
    return outcome()


def classify(outcome: StreamOutcome, expected: StreamOutcome) -> str:
    """One of OUTCOMES for a stream run under a fault."""
    if outcome.error is not None:
        return "failed"
    if expected.vectors:
        same = len(outcome.vectors) == len(expected.vectors) and all(
            len(got) == len(want)
            and max(abs(a - b) for a, b in zip(got, want, strict=True)) <= EMBEDDING_TOLERANCE
            for got, want in zip(outcome.vectors, expected.vectors, strict=True)
        )
        return "identical" if same else "corrupted"
    same = outcome.text == expected.text and outcome.finish_reason == expected.finish_reason
    if same and expected.logprobs:
        # Log-probabilities of a prompt read again after a failover may be summed in
        # other chunks: equal within the embeddings' tolerance, the tokens exactly.
        same = len(outcome.logprobs) == len(expected.logprobs) and all(
            abs(a - b) <= EMBEDDING_TOLERANCE
            for a, b in zip(outcome.logprobs, expected.logprobs, strict=True)
        )
    return "identical" if same else "corrupted"


class ChaosRun:
    """Rounds of concurrent streams with one fault each, on a started mesh."""

    def __init__(
        self,
        mesh: MeshProcesses,
        model: str,
        specs: list[StreamSpec],
        rng: random.Random,
        *,
        streams_per_round: int = 4,
        full_stages: int = 3,
        stop_range_s: tuple[float, float] = (1.0, 15.0),
    ) -> None:
        self.mesh = mesh
        self.model = model
        self.specs = specs
        self.rng = rng
        self.streams_per_round = streams_per_round
        self.full_stages = full_stages
        self.stop_range_s = stop_range_s
        self.expected: dict[int, StreamOutcome] = {}
        self.records: list[RoundRecord] = []
        self.mismatches: list[tuple[StreamSpec, StreamOutcome, StreamOutcome]] = []

    def baseline(self) -> None:
        """Every spec's output with no fault (one at a time)."""
        for index, spec in enumerate(self.specs):
            outcome = run_stream(self.mesh.http_url, self.model, spec)
            if outcome.error is not None:
                what = spec.prompt or spec.messages or f"{len(spec.inputs)} embeddings"
                raise RuntimeError(f"the no-fault run of {what!r} failed: {outcome.error}")
            self.expected[index] = outcome

    def pick_fault(self, kind: str) -> Fault:
        stages = [s for s in self.mesh.status().stages if s.assigned and s.stage_index > 0]
        target = self.rng.choice(stages).node_id if stages else ""
        if kind == "stop":
            return Fault("stop", target, round(self.rng.uniform(*self.stop_range_s), 1))
        if kind == "throttle":
            return Fault("throttle", target, round(self.rng.uniform(2.0, 6.0), 1))
        if kind == "kill":
            return Fault("kill", target)
        if kind == "link":
            return Fault("link", target, round(self.rng.uniform(1.0, 10.0), 1))
        if kind == "reset":
            return Fault("reset", target)
        if kind == "hang":
            return Fault("hang", target, round(self.rng.uniform(2.0, 30.0), 1))
        if kind == "pause":
            return Fault("pause", "", round(self.rng.uniform(1.0, 12.0), 1))
        return Fault("coordinator", "", round(self.rng.uniform(0.5, 4.0), 1))

    def round(self, fault: Fault, chosen: list[int] | None = None) -> RoundRecord:
        """Run one round with ``fault`` (during the specs of index ``chosen``, else
        ``streams_per_round`` drawn at random); then restore the mesh to full size."""
        record = RoundRecord(fault)
        if chosen is None:
            chosen = self.rng.sample(range(len(self.specs)), self.streams_per_round)
        started = [threading.Event() for _ in chosen]
        term_before = self.mesh.status().term
        # A hang starts before the streams (on a thread of its own, which must also
        # end it): streams that finish within a few hundred milliseconds could end
        # before it began, and a stage that hangs between requests is a case too.
        hang = None
        if fault.kind == "hang":
            watcher = _RecoveryWatch(self.mesh, term_before)
            hang = self._start_hang(fault)
        with ThreadPoolExecutor(len(chosen) + 1) as pool:
            futures = [
                pool.submit(run_stream, self.mesh.http_url, self.model, self.specs[i], started[n])
                for n, i in enumerate(chosen)
            ]
            if hang is None:
                for event in started:
                    event.wait(120)
                time.sleep(self.rng.uniform(0.0, 0.5))
                watcher = _RecoveryWatch(self.mesh, term_before)
                self._inject(fault)
            outcomes = [f.result(timeout=600) for f in futures]
            if hang is not None:
                hang.join()
        for index, outcome in zip(chosen, outcomes, strict=True):
            verdict = classify(outcome, self.expected[index])
            record.outcomes.append(verdict)
            record.requests.append(request_kind(self.specs[index]))
            if outcome.error is not None:
                record.errors.append(outcome.error)
            if verdict == "corrupted":
                self.mismatches.append((self.specs[index], self.expected[index], outcome))
        # A killed stage always ends its term, but the streams may all end before the
        # coordinator misses its heartbeats: wait for that failover.
        record.failover, record.recovery_s = watcher.result(
            expected=fault.kind in ("kill", "reset")
        )
        self._restore(fault)
        self.records.append(record)
        return record

    def _start_hang(self, fault: Fault) -> threading.Thread:
        """Freeze the target's frame threads on a thread of their own for the
        fault's duration; return once they are frozen."""
        logger.info("fault: %s", fault)
        first = any(
            s.node_id == fault.target and s.assigned and s.stage_index == 0
            for s in self.mesh.status().stages
        )
        names = HANG_THREADS_STAGE0 if first else HANG_THREADS
        frozen = threading.Event()
        failed: list[BaseException] = []

        def hang() -> None:
            try:
                self.mesh.hang_threads(fault.target, names, fault.duration_s, frozen)
            except BaseException as error:  # noqa: BLE001 - re-raised by the round
                failed.append(error)
                frozen.set()

        thread = threading.Thread(target=hang, name="chaos-hang", daemon=True)
        thread.start()
        frozen.wait()
        if failed:
            thread.join()
            raise failed[0]
        return thread

    def _inject(self, fault: Fault) -> None:
        logger.info("fault: %s", fault)
        mesh = self.mesh
        if fault.kind == "kill":
            mesh.kill_stage(fault.target)
        elif fault.kind == "stop":
            mesh.signal_stage(fault.target, signal.SIGSTOP)
            time.sleep(fault.duration_s)
            mesh.signal_stage(fault.target, signal.SIGCONT)
        elif fault.kind == "throttle":
            end = time.monotonic() + fault.duration_s
            while time.monotonic() < end:  # stopped 60% of each 50 ms
                mesh.signal_stage(fault.target, signal.SIGSTOP)
                time.sleep(0.03)
                mesh.signal_stage(fault.target, signal.SIGCONT)
                time.sleep(0.02)
        elif fault.kind == "link":
            mesh.set_link(fault.target, up=False)
            time.sleep(fault.duration_s)
            mesh.set_link(fault.target, up=True)
        elif fault.kind == "reset":
            if not mesh.reset_links(fault.target):
                raise RuntimeError(f"no connection of {fault.target} to another stage to reset")
        elif fault.kind == "pause":
            mesh.coordinator.send_signal(signal.SIGSTOP)
            time.sleep(fault.duration_s)
            mesh.coordinator.send_signal(signal.SIGCONT)
        elif fault.kind == "coordinator":
            mesh.kill_coordinator()
            time.sleep(fault.duration_s)
            mesh.start_coordinator_again()
        else:
            raise ValueError(f"unknown fault kind {fault.kind!r}; one of {FAULT_KINDS}")

    def _restore(self, fault: Fault) -> None:
        """Start a killed stage again and wait until the mesh serves on full size."""
        if fault.kind == "kill":
            self.mesh.start_stage(fault.target)

        def full() -> bool:
            status = _try_status(self.mesh)
            if status is None or status.state != "serving":
                return False
            assigned = [s for s in status.stages if s.assigned]
            return len(assigned) >= self.full_stages

        wait_for(full, 180, f"the mesh to serve on {self.full_stages} stages again")


class _RecoveryWatch:
    """Polls the coordinator from the moment of a fault: did a new term serve, and
    how long after the fault?"""

    def __init__(self, mesh: MeshProcesses, term_before: int) -> None:
        self.mesh = mesh
        self.term_before = term_before
        self.started = time.monotonic()
        self.served_at: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.is_set():
            status = _try_status(self.mesh)
            if status is not None and status.state == "serving":
                if status.term > self.term_before:
                    self.served_at = time.monotonic()
                    return
            time.sleep(0.1)

    def result(self, settle_s: float = 180.0, expected: bool = False) -> tuple[bool, float | None]:
        """(failover, seconds to serving again); waits for a failover in progress, or
        for one that is ``expected`` (a killed stage)."""
        status = _try_status(self.mesh)
        in_progress = status is None or status.state != "serving"
        if in_progress or expected:
            self._thread.join(settle_s)
        self._done.set()
        self._thread.join(5)
        if self.served_at is None:
            return False, None
        return True, round(self.served_at - self.started, 2)


def _try_status(mesh: MeshProcesses):
    from mesh.errors import MeshError

    try:
        return mesh.status()
    except MeshError:
        return None


def summarize(records: list[RoundRecord]) -> dict:
    """Counts by fault kind and outcome, and recovery time percentiles."""
    by_kind: dict[str, dict[str, int]] = {}
    for record in records:
        row = by_kind.setdefault(
            record.fault.kind, {"faults": 0, "failovers": 0} | dict.fromkeys(OUTCOMES, 0)
        )
        row["faults"] += 1
        row["failovers"] += int(record.failover)
        for outcome in record.outcomes:
            row[outcome] += 1
    by_request: dict[str, dict[str, int]] = {}
    for record in records:
        for kind, outcome in zip(record.requests, record.outcomes, strict=True):
            row = by_request.setdefault(kind, dict.fromkeys(OUTCOMES, 0))
            row[outcome] += 1
    recoveries = sorted(r.recovery_s for r in records if r.recovery_s is not None)
    return {
        "by_kind": by_kind,
        "by_request": by_request,
        "totals": {
            "faults": len(records),
            **{o: sum(row[o] for row in by_kind.values()) for o in OUTCOMES},
        },
        "recovery_s": _percentiles(recoveries),
    }


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "max": None, "count": 0}
    cut = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else values * 9
    return {
        "p50": round(statistics.median(values), 2),
        "p90": round(cut[8], 2),
        "max": round(max(values), 2),
        "count": len(values),
    }


def render_table(summary: dict) -> str:
    """A Markdown table of ``summarize`` output."""
    lines = [
        "| fault | faults | failovers | identical | failed (error) | corrupted |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for kind, row in sorted(summary["by_kind"].items()):
        lines.append(
            f"| {kind} | {row['faults']} | {row['failovers']} | {row['identical']} | "
            f"{row['failed']} | {row['corrupted']} |"
        )
    totals = summary["totals"]
    lines.append(
        f"| **all** | {totals['faults']} | | {totals['identical']} | {totals['failed']} | "
        f"**{totals['corrupted']}** |"
    )
    by_request = summary.get("by_request", {})
    if by_request:
        lines.append("")
        lines.append(
            "By request: "
            + "; ".join(
                f"{kind} {row['identical']} identical, {row['failed']} failed, "
                f"{row['corrupted']} corrupted"
                for kind, row in sorted(by_request.items())
            )
        )
    rec = summary["recovery_s"]
    if rec["count"]:
        lines.append("")
        lines.append(
            f"Recovery (fault to serving again, {rec['count']} failovers): "
            f"p50 {rec['p50']} s, p90 {rec['p90']} s, max {rec['max']} s"
        )
    return "\n".join(lines)
