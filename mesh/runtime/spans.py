"""The rows of a batched forward pass: which session each span of rows belongs to,
and what the pass produced for each."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mesh.errors import MeshError
from mesh.types import SamplingParams


@dataclass(frozen=True)
class Span:
    """One session's rows in a batched forward pass: ``count`` tokens from absolute
    position ``pos_start``. On the last stage, logits are computed for the span's
    last ``logit_rows`` rows only (all of them when negative; none when 0: a prompt
    chunk after which nothing is sampled)."""

    session_id: str
    pos_start: int
    count: int
    logit_rows: int = -1
    # A new session is created only for a span that may create one (a prompt's
    # first segment); it then records the request and sampling parameters.
    creates: bool = True
    request_id: str = ""
    sampling: SamplingParams | None = None
    # A new session starting at pos_start > 0 copies its first pos_start positions
    # from this kept prefix (SessionTable.keep_prefix).
    prefix_from: str = ""
    # On the last stage: pool the span's rows after the final norm ("mean": their
    # sum, "last": its last row; "" none) into ``BatchOutput.pooled``.
    pooling: str = ""

    def logits_wanted(self) -> int:
        return self.count if self.logit_rows < 0 else min(self.logit_rows, self.count)


@dataclass
class BatchOutput:
    """What a batched forward pass produced. ``rows`` holds, in span order, the
    output rows of every span that ran (hidden states, or on the last stage the
    logits of its wanted rows); ``placed`` maps a span's index to its first row in
    ``rows`` and its row count; ``errors`` maps the index of a span that was refused
    (bad position, over a limit, ...) to why. The other spans ran."""

    rows: torch.Tensor | None
    placed: dict[int, tuple[int, int]] = field(default_factory=dict)
    errors: dict[int, MeshError] = field(default_factory=dict)
    # On the last stage, by span index: a pooling span's rows after the final norm,
    # pooled (float32 ``[hidden]``).
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)

    def of(self, index: int) -> torch.Tensor:
        """The output rows of span ``index``."""
        start, count = self.placed[index]
        return self.rows[start : start + count]  # type: ignore[index]
