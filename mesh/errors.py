"""Error classes of the mesh and their mapping to gRPC and HTTP status codes.

Three families: the caller's fault (InvalidRequest), retryable (Unavailable) and
fatal (a bug or corrupted state). Servicers and the HTTP layer map errors through
``grpc_code_name`` and ``http_status`` here and nowhere else.
"""

from __future__ import annotations


class MeshError(Exception):
    """Base class. ``grpc_code`` is a grpc.StatusCode name; ``http_status`` an int."""

    grpc_code: str = "INTERNAL"
    http_status: int = 500
    openai_type: str = "server_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(MeshError):
    """The caller sent something wrong; retrying the same input fails again."""

    grpc_code = "INVALID_ARGUMENT"
    http_status = 400
    openai_type = "invalid_request_error"


class PackageError(InvalidRequest):
    """A model package is missing, malformed, corrupt or unsupported."""


class UnsupportedArchitecture(PackageError):
    """The model's architecture is not one the runtime can split."""


class NotFound(MeshError):
    grpc_code = "NOT_FOUND"
    http_status = 404
    openai_type = "invalid_request_error"


class CapacityExceeded(MeshError):
    """Session or queue limits reached; retry later."""

    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 429
    openai_type = "rate_limit_error"


# What torch's allocators say when memory runs out: the CPU allocator raises a plain
# RuntimeError ("DefaultCPUAllocator: can't allocate memory"), CUDA's an
# OutOfMemoryError ("CUDA out of memory").
_OUT_OF_MEMORY_MARKS = ("can't allocate memory", "out of memory")


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation that failed for want of memory."""
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True
    return isinstance(error, RuntimeError) and any(
        mark in str(error) for mark in _OUT_OF_MEMORY_MARKS
    )


class Unavailable(MeshError):
    """A peer is gone or the pipeline is not ready; retry later."""

    grpc_code = "UNAVAILABLE"
    http_status = 503
    openai_type = "service_unavailable"


class LinkUnreachable(Unavailable):
    """A stage could not open its data link to a neighbour: ``link`` is ``forward``
    (to the next stage) or ``return`` (the last stage's, to stage 0). The coordinator
    plans around the node the link could not reach (mesh/grpc_util.py carries
    ``link`` in the status's trailing metadata)."""

    def __init__(self, message: str, link: str) -> None:
        super().__init__(message)
        self.link = link


class LoadCancelled(Unavailable):
    """A stage's Load was given up while it waited for a neighbour: a Release or a
    Claim of a newer term came for it (the coordinator has given up that attempt)."""


class StaleTerm(MeshError):
    """A request carried a term older than one already accepted. ``held_term`` is
    the term the refusing node holds (0: not said)."""

    grpc_code = "FAILED_PRECONDITION"
    http_status = 409
    openai_type = "invalid_request_error"

    def __init__(self, message: str, held_term: int = 0) -> None:
        super().__init__(message)
        self.held_term = held_term


class PrefixMissing(MeshError):
    """A stage does not hold the kept prefix a new session was to start from (it
    was evicted there, or the stage restarted): stage 0 sends the prompt again
    from position 0."""

    grpc_code = "ABORTED"
    http_status = 503
    openai_type = "service_unavailable"


class Unauthenticated(MeshError):
    grpc_code = "UNAUTHENTICATED"
    http_status = 401
    openai_type = "authentication_error"


class Fatal(MeshError):
    """A bug or corrupted state: not the caller's fault, not retryable."""


_BY_GRPC_CODE: dict[str, type[MeshError]] = {
    "INVALID_ARGUMENT": InvalidRequest,
    "NOT_FOUND": NotFound,
    "RESOURCE_EXHAUSTED": CapacityExceeded,
    "UNAVAILABLE": Unavailable,
    "DEADLINE_EXCEEDED": Unavailable,
    "FAILED_PRECONDITION": StaleTerm,
    "UNAUTHENTICATED": Unauthenticated,
    "ABORTED": PrefixMissing,
}


def grpc_code_name(error: BaseException) -> str:
    """The gRPC status code name for an exception (INTERNAL for unknown ones)."""
    return error.grpc_code if isinstance(error, MeshError) else "INTERNAL"


def from_code(code: str, message: str) -> MeshError:
    """Rebuild a typed error from a gRPC status code name and message."""
    return _BY_GRPC_CODE.get(code, Fatal)(message)
