"""Per-request speculation counters, mergeable into aggregates."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass
class Telemetry:
    """Counters of one request's decode rounds (or, merged, of many requests).

    ``rounds`` counts every decode round; ``windows`` the rounds that carried draft
    tokens; ``emitted`` the tokens those rounds committed.
    """

    drafted: int = 0
    accepted: int = 0
    windows: int = 0
    rounds: int = 0
    emitted: int = 0
    draft_time_s: float = 0.0
    round_time_s: float = 0.0

    def record_round(
        self,
        proposed: int,
        accepted: int,
        emitted: int,
        round_time_s: float = 0.0,
        draft_time_s: float = 0.0,
    ) -> None:
        """Count one decode round (``proposed == 0`` for a plain decode round)."""
        self.rounds += 1
        self.emitted += emitted
        self.round_time_s += round_time_s
        self.draft_time_s += draft_time_s
        if proposed > 0:
            self.windows += 1
            self.drafted += proposed
            self.accepted += accepted

    @property
    def accept_rate(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_tokens_per_round(self) -> float:
        """Committed tokens per decode round (1.0 without speculation)."""
        return self.emitted / self.rounds if self.rounds else 0.0

    def merged(self, other: Telemetry) -> Telemetry:
        """A new Telemetry with both sets of counters summed."""
        sums = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        return Telemetry(**sums)

    def __add__(self, other: Telemetry) -> Telemetry:
        return self.merged(other)

    def to_dict(self) -> dict[str, Any]:
        """The ``timings`` block fields of an HTTP response."""
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "accept_rate": round(self.accept_rate, 4),
            "windows": self.windows,
            "rounds": self.rounds,
            "mean_tokens_per_round": round(self.mean_tokens_per_round, 4),
        }
