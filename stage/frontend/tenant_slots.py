"""Generations running per tenant, held to each tenant's ``max_concurrent`` from the
API key file (mesh/api_keys.py): on a mesh shared by several keys, one tenant's
burst cannot take every slot of the engine. The server's own limits
(``--max-concurrent-requests``, the queue) still apply to everybody together."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stage.frontend.errors import OpenAIError, bad_request


class TenantSlots:
    """Counts a tenant's running generations (one per choice); used from the event
    loop only."""

    def __init__(self, gauge: Any = None) -> None:
        self._running: dict[str, int] = {}
        # mesh_tenant_running_generations (a labelled prometheus Gauge), or None.
        self._gauge = gauge

    def _show(self, tenant: str) -> None:
        if self._gauge is not None and tenant:
            self._gauge.labels(tenant=tenant).set(self.running(tenant))

    def running(self, tenant: str) -> int:
        return self._running.get(tenant, 0)

    def claim(self, tenant: str, count: int, limit: int | None) -> list[Callable[[], None]]:
        """One release per generation, or 429 (400 when ``count`` alone exceeds the
        limit: it could never be admitted)."""
        if limit is not None:
            if count > limit:
                raise bad_request(
                    f"this request asks for {count} generations (prompts times n), but "
                    f"your key may run at most {limit} at once; send fewer",
                    "n",
                )
            if self.running(tenant) + count > limit:
                raise OpenAIError(
                    429,
                    f"your key has {self.running(tenant)} generation(s) running and its limit "
                    f"is {limit}; retry when one has finished",
                    headers={"Retry-After": "1"},
                )
        self._running[tenant] = self.running(tenant) + count
        self._show(tenant)
        return [self._release_one(tenant) for _ in range(count)]

    def _release_one(self, tenant: str) -> Callable[[], None]:
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._running[tenant] -= 1
                if not self._running[tenant]:
                    del self._running[tenant]
                self._show(tenant)

        return release
