"""The sections of the configuration tree: every setting of ``mesh-coordinator up``
and ``mesh-stage join``, each default written once.

- ``[coordinator]``: the coordinator process (``up``).
- ``[stage]``: a stage process (``join``); ``up`` takes the fields that apply to
  the stage processes it starts (device, threads, arithmetic, prefix cache).
- ``[frontend]``: stage 0's OpenAI API and engine core. ``up`` sends these to stage
  0 with its Load (a stage 0 started by ``join --frontend`` elsewhere gets them
  too); a value the stage 0 process was given itself wins.
- Speculation (``[defaults.speculative]``, ``[models."<id>".speculative]``) and
  ``[security]`` keep their own tables, resolved by ``mesh.config`` and
  ``mesh.security`` with the same precedence.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mesh.netaddr import coordinator_setting, host_port_setting
from mesh.settings.tree import setting
from mesh.types import DEFAULT_PREFIX_BYTES, DEFAULT_PREFIX_TOKENS
from mesh.units import parse_bytes

# Most torch threads a stage takes (a bound far above any host's cores).
MAX_THREADS = 4096

ROW_INVARIANT = ("auto", "on", "off")
QUANTISED_KERNELS = ("auto", "native", "torch")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "debug", "info", "warning", "error")


@dataclass(frozen=True)
class CoordinatorConfig:
    model: str = setting("default", "package dir, HF repo, or 'default'")
    quant: str | None = setting(
        None, "with --model default: serve a quantised build of it", choices=("int4", "int8")
    )
    listen: str = setting(
        "0.0.0.0:7070", "coordinator gRPC HOST:PORT", parse=host_port_setting(any_port=True)
    )
    advertise: str | None = setting(
        None,
        "address other hosts use to reach this head (its coordinator, stage 0 and HTTP "
        "API); default: the listen host, or this host's first global address when "
        "listening on 0.0.0.0",
    )
    no_local_stage: bool = setting(False, "do not run a local stage 0")
    stage0_port: int = setting(
        0,
        "gRPC port of the local stage 0, at the listen host (0: any free port); fix it, "
        "with stage0_data_port, where a firewall opens only known ports",
        minimum=0,
        maximum=65535,
    )
    stage0_data_port: int = setting(
        0,
        "framed TCP data port of the local stage 0 (0: any free port); the last stage "
        "sends it the tokens there",
        minimum=0,
        maximum=65535,
    )
    spawn_stages: int = setting(0, "extra local stage processes", minimum=0)
    min_stages: int = setting(0, "wait for this many stages", minimum=0)
    max_stages: int = setting(0, "use at most this many stages (0: no limit)", minimum=0)
    rebalance_spread: float = setting(
        0.15,
        "plan the layers again, with the stages' measured compute, when their measured step "
        "times differ by more than this fraction and stage 0 is idle (0: never)",
        minimum=0,
    )
    wire_dtype: str = setting(
        "f32", "activation dtype between stages", choices=("f32", "f16", "bf16", "int8")
    )
    dtype: str = setting(
        "auto",
        "compute dtype (auto: bfloat16 for a quantised package, else the package's dtype)",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    kv_max_sessions: int = setting(
        0,
        "sessions every stage keeps KV for (0: as many as frontend.max_concurrent_requests)",
        minimum=0,
    )
    max_tokens_per_session: int = setting(0, "positions per session (0: context)", minimum=0)
    stage_threads: int = setting(0, "torch threads per local stage (0: cores / stages)", minimum=0)
    heartbeat_timeout: float = setting(3.0, "seconds without a heartbeat: dead", minimum=0.1)
    stall_timeout: float = setting(
        20.0,
        "seconds stage 0 may wait for a frame's answer (or 10 times the round it should "
        "take, if longer) before the stage holding it is taken as stuck while it still "
        "heartbeats, planned around and left out of plans for a while (0: never)",
        minimum=0,
    )
    forget_dead_after: float = setting(
        600.0, "seconds after which a dead node leaves the registry (0: never)", minimum=0
    )
    state_file: Path | None = setting(
        None,
        "JSON written once serving; also keeps the highest term used, so that a restarted "
        "coordinator continues above it",
    )
    load_attempts: int = setting(
        3,
        "before the mesh first serves, exit non-zero after this many failed load attempts "
        "in a row (0: keep trying)",
        minimum=0,
    )
    metrics_port: int | None = setting(
        None,
        "serve the coordinator's Prometheus metrics on this port, at its listen host (0: a "
        "free port, logged)",
        minimum=0,
        maximum=65535,
    )
    stage_metrics_port_base: int | None = setting(
        None,
        "local stage i serves its metrics on this port + i (0: each a free port, logged in "
        "its own log)",
        minimum=0,
        maximum=65535,
    )
    discovery: bool = setting(
        True,
        "answer LAN discovery on UDP at the gRPC port, for stages joined with --coordinator auto",
    )
    log_level: str | None = setting(None, "logging level", choices=LOG_LEVELS)


@dataclass(frozen=True)
class StageConfig:
    coordinator: str = setting(
        "127.0.0.1:7070",
        "coordinator HOST:PORT, or auto (auto:PORT): find it on this host's networks by "
        "UDP broadcast",
        parse=coordinator_setting,
    )
    listen: str = setting(
        "0.0.0.0:7071", "gRPC bind HOST:PORT (port 0: any)", parse=host_port_setting(any_port=True)
    )
    advertise: str | None = setting(
        None,
        "host other nodes use to reach this one (default: the listen host, or, when "
        "listening on 0.0.0.0, this host's address on the route to the coordinator)",
    )
    node_id: str | None = setting(
        None,
        "node name; default: the host name and a digest of the cache directory, the same "
        "on every restart, so a restarted stage takes its place back",
    )
    device: str = setting("cpu", "torch device, e.g. cpu or cuda:0")
    memory: int = setting(
        0,
        "memory offered for weights and KV, e.g. 20GiB (0: measure it: a CUDA device's free "
        "memory, or on a CPU the available RAM less memory_margin)",
        parse=parse_bytes,
    )
    memory_margin: int = setting(
        1 << 30,
        "on a CPU, RAM left out of the measured offer for everything besides weights and KV "
        "(activations, the frontend, other processes), e.g. 2GiB",
        parse=parse_bytes,
        minimum=0,
    )
    speed: float = setting(1.0, "relative speed hint", minimum=0.0)
    cache_dir: Path | None = setting(None, "slice cache directory (default: $MESH_HOME/slices)")
    threads: int = setting(
        0, "torch CPU threads (0: torch's default)", minimum=0, maximum=MAX_THREADS
    )
    compile: bool = setting(
        False,
        "run decode steps through torch.compile (compiles while loading; falls back to "
        "eager where it cannot compile)",
    )
    quantised_kernel: str = setting(
        "auto",
        "CPU int4/int8 linears: native runs the stage's own kernels (int8 activations per "
        "block of 32, AVX-512 VNNI dot products, a weight decoded once per call: cost grows "
        "slowly with rows), built with the system C compiler on first use; torch runs "
        "torch's weight-only kernels; auto: native where the CPU and a compiler allow it",
        choices=QUANTISED_KERNELS,
    )
    quantised_gemm: bool = setting(
        False,
        "with torch's kernels (quantised_kernel torch, or where native cannot run), CPU "
        "int4/int8 linears of 64+ rows dequantise and run a float32 GEMM: 1.25-2x faster "
        "there, but a row's result then depends on the rows beside it, so answers may "
        "change with load (turns row_invariant off)",
    )
    row_invariant: str = setting(
        "auto",
        "compute every token's row the same way whether it runs alone, in a verify window "
        "or in a batch, so answers never change with load or speculation (CPU). auto: on "
        "for int4/int8 packages (measured cost: at most 6.4%% decode speed on the int4 "
        "package), off for dense ones (costs float32/bfloat16 10-30%%); off: the previous "
        "kernels",
        choices=ROW_INVARIANT,
    )
    stuck_exit_after: float = setting(
        600.0,
        "exit (status 70) when one frame has been processing this many seconds: a hung "
        "device call or deadlock that only a restart clears (the coordinator has planned "
        "around the stage long before; systemd, Kubernetes or `up` start it again). 0: "
        "never",
        minimum=0,
    )
    gc_freeze: bool = setting(
        True,
        "after loading, freeze the objects alive out of Python's garbage collector's way "
        "(gc.freeze), so that a full collection examines only what serving made: one of a "
        "loaded stage 0 takes 150-170 ms on a 2-core VM, a pause of every stream",
    )
    inline_frames: bool = setting(
        True,
        "process a frame that arrives while the stage is idle on the thread that received "
        "it (off: every frame goes through the stage's frame worker thread, one more "
        "thread hand-over per hop)",
    )
    cuda_graphs: bool = setting(
        False,
        "on a CUDA device, replay decode steps as CUDA graphs (checked against eager steps "
        "while loading; falls back to eager where they cannot be captured)",
    )
    prefix_cache_mb: float = setting(
        DEFAULT_PREFIX_BYTES / 2**20,
        "most memory this stage gives to kept prefixes (least recently used first out; "
        "0: keep none)",
        minimum=0,
    )
    inject_delay_ms: float = setting(
        0.0,
        "add this latency to every outgoing data hop (benchmarks; emulates a network)",
        minimum=0,
    )
    data_transport: str = setting(
        "tcp",
        "how other stages send this one frames: tcp (framed TCP on data_port, the lean "
        "hop) or grpc (the StageData streams on the gRPC port; one port to open)",
        choices=("tcp", "grpc"),
    )
    data_port: int = setting(
        0,
        "port of the framed TCP data listener at the listen host (0: any free port; "
        "neighbours learn it over gRPC)",
        minimum=0,
        maximum=65535,
    )
    frontend: bool = setting(False, "host the OpenAI API: this stage becomes stage 0")
    metrics_port: int | None = setting(
        None,
        "serve this stage's Prometheus metrics on this port, at its listen host (0: a free "
        "port, logged)",
        minimum=0,
        maximum=65535,
    )
    log_level: str | None = setting(None, "logging level", choices=LOG_LEVELS)


@dataclass(frozen=True)
class FrontendConfig:
    http_host: str = setting("127.0.0.1", "bind host of the OpenAI API (0.0.0.0: every interface)")
    http_port: int = setting(8000, "port of the OpenAI API (0: any)", minimum=0, maximum=65535)
    api_key_file: Path | None = setting(
        None,
        "file of HTTP API keys, one per line as KEY or NAME KEY (or set MESH_API_KEY); read "
        "again when it changes",
    )
    max_concurrent_requests: int = setting(
        16, "requests generating at once (each holds a session on every stage)", minimum=1
    )
    max_queued: int = setting(32, "requests waiting for a slot before 429", minimum=0)
    prefix_cache_tokens: int = setting(
        DEFAULT_PREFIX_TOKENS,
        "positions of finished requests kept on every stage for later prompts that start "
        "with them (0: no prefix cache)",
        minimum=0,
    )
    max_batch_tokens: int = setting(
        512,
        "tokens one step of stage 0's engine core may hold (decode rows first, prompt "
        "chunks in the rest)",
        minimum=1,
    )
    max_windows_in_flight: int = setting(
        4,
        "verify windows one request may have in the pipe at once, drafted ahead of "
        "their verdicts; the cost model picks the depth up to this (1: wait for each "
        "verdict)",
        minimum=1,
        maximum=16,
    )
    drain_timeout: float = setting(
        30.0,
        "on SIGTERM, seconds stage 0 lets running requests finish (new ones get 503 and "
        "/health says draining) before it stops (0: stop at once)",
        minimum=0,
    )
    reasoning_format: str = setting(
        "auto",
        "reasoning models' thoughts (<think> ... </think>, Magistral's [THINK] ... "
        "[/THINK]): auto returns them apart from the answer, as reasoning_content, where "
        "the model's chat template uses them; none leaves them in the answer",
        choices=("auto", "none"),
    )
    stored_responses: int = setting(
        1024,
        "responses of /v1/responses stage 0 keeps in memory for previous_response_id and "
        "GET /v1/responses/{id} (0: keep none)",
        minimum=0,
    )
    sampling_defaults: str = setting(
        "model",
        "what a request that leaves temperature, top_p, top_k, min_p or "
        "repetition_penalty unset samples with: model takes the values the model's "
        "generation_config.json recommends (as vLLM does), openai OpenAI's (temperature "
        "1, top_p 1, no top-k)",
        choices=("model", "openai"),
    )
    embedding_pooling: str = setting(
        "mean",
        "how /v1/embeddings pools a prompt's positions of the model's final hidden state: "
        "mean (every position) or last (the last position, for models trained to embed "
        "that way)",
        choices=("mean", "last"),
    )
    decode_stall_ms: float = setting(
        250.0,
        "while other requests decode, a prompt chunk is cut so that its step costs about "
        "this long (ms) by the measured cost of prompt rows: their next tokens wait about "
        "this long for a long prompt, not a whole --max-batch-tokens chunk (0: the step "
        "token budget alone)",
        minimum=0,
    )
    prompts_ahead: bool = setting(
        True,
        "with the pipe full, send new requests' first prompt chunks at once in one extra "
        "frame rather than in the next frame after an answer (time to first token under "
        "load)",
    )


# Fields of [stage] that `up` takes for the stage processes it starts.
LOCAL_STAGE_FIELDS = (
    "device",
    "compile",
    "quantised_kernel",
    "quantised_gemm",
    "row_invariant",
    "cuda_graphs",
    "inline_frames",
    "gc_freeze",
    "stuck_exit_after",
    "prefix_cache_mb",
    "inject_delay_ms",
    "data_transport",
    "cache_dir",
)
# Fields of [frontend] the coordinator sends stage 0 with its Load: the rest (where it
# listens, its key) belong to the stage 0 process.
SERVING_FIELDS = (
    "max_concurrent_requests",
    "max_queued",
    "prefix_cache_tokens",
    "max_batch_tokens",
    "max_windows_in_flight",
    "prompts_ahead",
    "decode_stall_ms",
)

SECTIONS = {"coordinator": CoordinatorConfig, "stage": StageConfig, "frontend": FrontendConfig}


def kv_sessions(coordinator: CoordinatorConfig, frontend: FrontendConfig) -> int:
    """Sessions each stage keeps KV for: the frontend's concurrent requests unless set."""
    return coordinator.kv_max_sessions or frontend.max_concurrent_requests
