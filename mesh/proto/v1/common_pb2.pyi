from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WireDType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WIRE_DTYPE_UNSPECIFIED: _ClassVar[WireDType]
    WIRE_DTYPE_F32: _ClassVar[WireDType]
    WIRE_DTYPE_F16: _ClassVar[WireDType]
    WIRE_DTYPE_BF16: _ClassVar[WireDType]
    WIRE_DTYPE_INT8: _ClassVar[WireDType]
WIRE_DTYPE_UNSPECIFIED: WireDType
WIRE_DTYPE_F32: WireDType
WIRE_DTYPE_F16: WireDType
WIRE_DTYPE_BF16: WireDType
WIRE_DTYPE_INT8: WireDType

class LayerRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "scales")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    dtype: WireDType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    scales: bytes
    def __init__(self, dtype: _Optional[_Union[WireDType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., scales: _Optional[bytes] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "prompt_tokens", "logprobs", "top_logprobs", "grammar", "min_tokens", "hold_back", "penalty_last_n", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_breakers", "dynatemp_range", "dynatemp_exponent")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOLD_BACK_FIELD_NUMBER: _ClassVar[int]
    PENALTY_LAST_N_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    TOP_N_SIGMA_FIELD_NUMBER: _ClassVar[int]
    XTC_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    XTC_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    DRY_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    DRY_BASE_FIELD_NUMBER: _ClassVar[int]
    DRY_ALLOWED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRY_PENALTY_LAST_N_FIELD_NUMBER: _ClassVar[int]
    DRY_BREAKERS_FIELD_NUMBER: _ClassVar[int]
    DYNATEMP_RANGE_FIELD_NUMBER: _ClassVar[int]
    DYNATEMP_EXPONENT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    prompt_tokens: int
    logprobs: bool
    top_logprobs: int
    grammar: str
    min_tokens: int
    hold_back: _containers.RepeatedScalarFieldContainer[int]
    penalty_last_n: int
    typical_p: float
    top_n_sigma: float
    xtc_probability: float
    xtc_threshold: float
    dry_multiplier: float
    dry_base: float
    dry_allowed_length: int
    dry_penalty_last_n: int
    dry_breakers: _containers.RepeatedScalarFieldContainer[int]
    dynatemp_range: float
    dynatemp_exponent: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_tokens: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., grammar: _Optional[str] = ..., min_tokens: _Optional[int] = ..., hold_back: _Optional[_Iterable[int]] = ..., penalty_last_n: _Optional[int] = ..., typical_p: _Optional[float] = ..., top_n_sigma: _Optional[float] = ..., xtc_probability: _Optional[float] = ..., xtc_threshold: _Optional[float] = ..., dry_multiplier: _Optional[float] = ..., dry_base: _Optional[float] = ..., dry_allowed_length: _Optional[int] = ..., dry_penalty_last_n: _Optional[int] = ..., dry_breakers: _Optional[_Iterable[int]] = ..., dynatemp_range: _Optional[float] = ..., dynatemp_exponent: _Optional[float] = ...) -> None: ...

class ErrorInfo(_message.Message):
    __slots__ = ("code", "message", "stage_index")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    stage_index: int
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., stage_index: _Optional[int] = ...) -> None: ...

class StageTiming(_message.Message):
    __slots__ = ("stage_index", "compute_ms", "queue_ms")
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    stage_index: int
    compute_ms: float
    queue_ms: float
    def __init__(self, stage_index: _Optional[int] = ..., compute_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ...) -> None: ...
