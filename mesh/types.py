"""Small frozen value types shared by every part of the mesh."""

from __future__ import annotations

from dataclasses import dataclass

from mesh.errors import InvalidRequest

# The prefix cache (docs/serving.md): positions of finished requests stage 0 keeps
# on every stage (mesh-stage join --prefix-cache-tokens), and the most memory one
# stage gives to them (--prefix-cache-mb).
DEFAULT_PREFIX_TOKENS = 16384
DEFAULT_PREFIX_BYTES = 2048 * 2**20
# The largest term a node accepts or reports: far beyond any mesh's reloads (one a
# second for a hundred million years), far below the wire's 64 bits, so the next
# term (one more than any seen) always fits.
MAX_TERM = 2**52
# The stall rule (docs/reliability.md): stage 0's wait for a frame's answer is
# overdue after the larger of the stall timeout and this many times the round the
# frame should take (or the longest recent round).
STALL_ROUND_FACTOR = 10.0
# How long a restarted coordinator waits for the stages of the pipeline that served
# to join it again before it plans with those alive (stage 0's local stall rule
# holds that long, plus the stall timeout, after the coordinator answers again).
RESTART_GRACE_S = 10.0


def check_term(term: int, what: str) -> int:
    """``term`` where it is at most ``MAX_TERM``; else InvalidRequest."""
    if not 0 <= term <= MAX_TERM:
        raise InvalidRequest(
            f"{what} term {term} is beyond {MAX_TERM} (2^52): terms count a mesh's "
            "loads; no coordinator sends such a term"
        )
    return term


@dataclass(frozen=True, order=True)
class LayerRange:
    """Half-open range of decoder layers: ``[start, end)``."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end <= self.start:
            raise InvalidRequest(
                f"layer range [{self.start}, {self.end}) is empty or negative; "
                "ranges are half-open [start, end) with 0 <= start < end"
            )

    def __len__(self) -> int:
        return self.end - self.start

    def __contains__(self, layer_index: object) -> bool:
        return isinstance(layer_index, int) and self.start <= layer_index < self.end

    def __iter__(self):
        return iter(range(self.start, self.end))

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"

    def check_within(self, layer_count: int) -> None:
        """Raise InvalidRequest unless the range lies inside ``[0, layer_count)``."""
        if self.end > layer_count:
            raise InvalidRequest(
                f"layer range {self} is outside [0, {layer_count}): "
                f"the model has {layer_count} layers"
            )

    def is_first(self) -> bool:
        return self.start == 0

    def is_last(self, layer_count: int) -> bool:
        return self.end == layer_count

    @classmethod
    def parse(cls, text: str) -> LayerRange:
        """Parse ``"2:4"`` or ``"[2, 4)"`` into ``LayerRange(2, 4)``."""
        cleaned = text.strip().strip("[]()").replace(",", ":")
        parts = [p.strip() for p in cleaned.split(":")]
        if len(parts) != 2 or not all(p.lstrip("-").isdigit() for p in parts):
            raise InvalidRequest(f"cannot parse layer range {text!r}; write it as START:END")
        return cls(int(parts[0]), int(parts[1]))


TOP_LOGPROBS_MAX = 20
# Largest |bias| of a logit_bias entry (OpenAI's range).
LOGIT_BIAS_MAX = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How the last stage picks tokens. ``temperature == 0`` is greedy.

    Penalties and biases (mesh/sampling.py ``adjust_logits``) act on the logits
    before temperature, for greedy requests too: ``repetition_penalty`` on every
    token of the prompt and the output (> 1 discourages them), ``presence_penalty``
    and ``frequency_penalty`` on output tokens (the tokens after the first
    ``prompt_tokens``), ``logit_bias`` adds to the listed tokens. ``min_p`` drops
    tokens whose probability is below ``min_p`` times the likeliest one's.
    ``penalty_last_n`` (0: all) limits the penalties to the last tokens.

    llama.cpp's samplers (off at their defaults; ``mesh/sampling.py``): DRY
    (``dry_*``, a logit penalty, greedy requests too), and when sampling
    ``top_n_sigma``, ``typical_p``, XTC (``xtc_*``) and dynamic temperature
    (``dynatemp_*``)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_tokens: int = 0
    # -1: no log-probabilities; 0..20: each emitted token's, with that many alternatives.
    top_logprobs: int = -1
    # Structured output (mesh/grammar.py): the JSON text {"type": "json_object"} or
    # {"type": "json_schema", "schema": {...}} the output must follow; "" for none.
    grammar: str = ""
    # ``min_tokens``: until the output holds this many tokens, the ``hold_back``
    # tokens (the request's stop tokens: EOS) cannot be chosen.
    min_tokens: int = 0
    hold_back: tuple[int, ...] = ()
    penalty_last_n: int = 0
    typical_p: float = 1.0
    top_n_sigma: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 0
    dry_breakers: tuple[int, ...] = ()
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k}")
        if not (0 <= self.seed < 2**64):
            raise InvalidRequest(f"seed must be in [0, 2**64), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                raise InvalidRequest(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (0.0 < self.repetition_penalty <= 10.0):
            raise InvalidRequest(
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"
            )
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}")
        if not -1 <= self.top_logprobs <= TOP_LOGPROBS_MAX:
            raise InvalidRequest(
                f"top_logprobs must be in [0, {TOP_LOGPROBS_MAX}], got {self.top_logprobs}"
            )
        if self.prompt_tokens < 0:
            raise InvalidRequest(f"prompt_tokens must be >= 0, got {self.prompt_tokens}")
        if self.min_tokens < 0 or any(token < 0 for token in self.hold_back):
            raise InvalidRequest(
                f"min_tokens ({self.min_tokens}) and the token ids held back "
                f"({list(self.hold_back)}) must be >= 0"
            )
        for token, bias in self.logit_bias:
            if token < 0 or not (-LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX):
                raise InvalidRequest(
                    f"logit_bias entry {token}: {bias} must name a token id >= 0 with a "
                    f"bias in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]"
                )
        self._check_llama_samplers()

    def _check_llama_samplers(self) -> None:
        ranges = (
            ("typical_p", 0.0, 1.0, False),
            ("top_n_sigma", 0.0, 100.0, True),
            ("xtc_probability", 0.0, 1.0, True),
            ("xtc_threshold", 0.0, 1.0, True),
            ("dry_multiplier", 0.0, 100.0, True),
            ("dry_base", 1.0, 10.0, True),
            ("dynatemp_range", 0.0, 10.0, True),
            ("dynatemp_exponent", 0.0, 10.0, False),
        )
        for name, low, high, closed in ranges:
            value = getattr(self, name)
            inside = (low <= value <= high) if closed else (low < value <= high)
            if not inside:
                bracket = "[" if closed else "("
                raise InvalidRequest(f"{name} must be in {bracket}{low:g}, {high:g}], got {value}")
        for name in ("penalty_last_n", "dry_allowed_length", "dry_penalty_last_n"):
            if getattr(self, name) < 0:
                raise InvalidRequest(f"{name} must be >= 0, got {getattr(self, name)}")
        if any(token < 0 for token in self.dry_breakers):
            raise InvalidRequest("dry_breakers must be token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties or biases change the logits before the choice."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.holds_back
            or self.dry_multiplier
        )

    @property
    def holds_back(self) -> bool:
        """Whether ``min_tokens`` keeps some tokens from being chosen early on."""
        return self.min_tokens > 0 and bool(self.hold_back)

    @property
    def uses_history(self) -> bool:
        """Whether the choice depends on the tokens before it (penalties, a grammar)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.grammar
            or self.holds_back
            or self.dry_multiplier
        )
