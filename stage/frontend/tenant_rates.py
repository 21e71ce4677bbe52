"""Requests and tokens per minute per tenant, from the API key file's ``rpm=N`` and
``tpm=N`` (mesh/api_keys.py): a tenant over either gets a 429 with ``Retry-After``
(and OpenAI's ``x-ratelimit-*`` headers), which the official clients wait out and
retry; other tenants go on.

Each limit is a bucket that holds up to a minute's allowance and refills at the
per-minute rate, continuously (a tenant may burst to its whole minute, then goes
at the rate). A request takes one request from its ``rpm`` bucket. Tokens are
known only as a request runs: its prompt tokens are taken when it is admitted and
its completion tokens when it ends, so a long answer can take the token bucket
below empty; a request is admitted while the bucket holds any tokens at all, and
refused until it refills past zero.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from mesh.api_keys import TenantLimits
from stage.frontend.errors import OpenAIError


@dataclass
class _Bucket:
    capacity: float
    level: float
    stamp: float

    def refill(self, capacity: float, now: float) -> None:
        """Refill at ``capacity`` per minute (a changed limit takes effect here)."""
        self.capacity = capacity
        self.level = min(capacity, self.level + (now - self.stamp) * capacity / 60.0)
        self.stamp = now

    def wait_s(self, need: float) -> float:
        """Seconds until the level reaches ``need``."""
        return max(0.0, (need - self.level) * 60.0 / self.capacity)


class TenantRates:
    """The tenants' buckets; used from the event loop only."""

    def __init__(self, counter: object = None) -> None:
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        # mesh_tenant_rate_limited_total (a labelled prometheus Counter), or None.
        self._counter = counter

    def _bucket(self, tenant: str, kind: str, capacity: int, now: float) -> _Bucket:
        bucket = self._buckets.get((tenant, kind))
        if bucket is None:
            bucket = self._buckets[(tenant, kind)] = _Bucket(capacity, capacity, now)
        bucket.refill(capacity, now)
        return bucket

    def admit(
        self, tenant: str, limits: TenantLimits, prompt_tokens: int, now: float | None = None
    ) -> None:
        """Take one request and the prompt's tokens, or raise 429."""
        now = time.monotonic() if now is None else now
        requests = tokens = None
        if limits.rpm is not None:
            requests = self._bucket(tenant, "requests", limits.rpm, now)
        if limits.tpm is not None:
            tokens = self._bucket(tenant, "tokens", limits.tpm, now)
        waits: list[tuple[str, float]] = []
        if requests is not None and requests.level < 1.0:
            waits.append(("requests", requests.wait_s(1.0)))
        if tokens is not None and tokens.level <= 0.0:
            waits.append(("tokens", max(tokens.wait_s(0.0), 1e-3)))
        if waits:
            kind, wait = max(waits, key=lambda w: w[1])
            if self._counter is not None:
                self._counter.labels(tenant=tenant, limit=kind).inc()  # type: ignore[attr-defined]
            headers = {"Retry-After": str(max(1, math.ceil(wait)))}
            headers |= _headers("requests", limits.rpm, requests)
            headers |= _headers("tokens", limits.tpm, tokens)
            per_minute = limits.rpm if kind == "requests" else limits.tpm
            raise OpenAIError(
                429,
                f"your key's rate limit of {per_minute} {kind} per minute is used up; "
                f"retry in {wait:.1f} s",
                code="rate_limit_exceeded",
                headers=headers,
            )
        if requests is not None:
            requests.level -= 1.0
        if tokens is not None:
            tokens.level -= prompt_tokens

    def charge(self, tenant: str, limits: TenantLimits, tokens: int) -> None:
        """Take a finished request's completion tokens."""
        if limits.tpm is None or tokens <= 0:
            return
        self._bucket(tenant, "tokens", limits.tpm, time.monotonic()).level -= tokens


def _headers(kind: str, limit: int | None, bucket: _Bucket | None) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers for one limit."""
    if limit is None or bucket is None:
        return {}
    return {
        f"x-ratelimit-limit-{kind}": str(limit),
        f"x-ratelimit-remaining-{kind}": str(max(0, math.floor(bucket.level))),
        f"x-ratelimit-reset-{kind}": f"{bucket.wait_s(bucket.capacity):.1f}s",
    }
