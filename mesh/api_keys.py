"""The HTTP API's keys, and the tenant each one names.

An API key file holds one key per line, either alone or after a tenant name
(``NAME KEY``), optionally followed by the tenant's limits, each at most once:
``max_concurrent=N`` (the most generations, choices, it may run at once),
``rpm=N`` (requests per minute) and ``tpm=N`` (prompt and completion tokens per
minute); blank lines and lines starting with ``#`` are skipped. A key given
alone names the tenant ``key-`` followed by 8 hex digits of its SHA-256 (stable,
and it tells nothing about the key). ``MESH_API_KEY`` gives one key.

The tenant is what the server trusts about who sent a request (a client chooses
its ``user`` field freely): the prefix cache is kept per tenant and the suffix
drafter's corpus per tenant and user, so that one tenant's text never shapes
another's latency; ``/metrics`` counts tokens per tenant; a tenant's
``max_concurrent`` caps its running generations (stage/frontend/tenant_slots.py)
and its ``rpm`` / ``tpm`` its rate (stage/frontend/tenant_rates.py).

The file is read again when it changes (checked at most once a second), so keys
are added, rotated and revoked without a restart; a file that stops parsing keeps
the keys read last, with an error in the log.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mesh.errors import InvalidRequest

logger = logging.getLogger(__name__)

TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
# A tenant's limits after its key: ``NAME=N``.
LIMIT_NAMES = ("max_concurrent", "rpm", "tpm")
# How often the key file's modification time is looked at.
RECHECK_S = 1.0


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's limits from its key's line (None: only the server's own)."""

    max_concurrent: int | None = None
    rpm: int | None = None
    tpm: int | None = None


NO_LIMITS = TenantLimits()


@dataclass(frozen=True)
class ApiKeys:
    """Keys (UTF-8 bytes) and the tenant each names; ``limits``: the tenants' limits
    (a tenant absent has only the server's own)."""

    entries: tuple[tuple[bytes, str], ...]
    limits: tuple[tuple[str, TenantLimits], ...] = ()

    def limits_of(self, tenant: str) -> TenantLimits:
        return dict(self.limits).get(tenant, NO_LIMITS)

    def limit_of(self, tenant: str) -> int | None:
        """The tenant's ``max_concurrent``."""
        return self.limits_of(tenant).max_concurrent

    def tenant_of(self, given: bytes) -> str | None:
        """The tenant of key ``given``, None when it is none of them. Every key is
        compared, in constant time each, whichever matches."""
        found = None
        for key, tenant in self.entries:
            if hmac.compare_digest(given, key) and found is None:
                found = tenant
        return found

    @property
    def tenants(self) -> tuple[str, ...]:
        return tuple(tenant for _, tenant in self.entries)

    @property
    def single_bare_key(self) -> bool:
        """True when there is one key, given alone (the file is the key itself)."""
        return len(self.entries) == 1 and self.entries[0][1] == bare_tenant(self.entries[0][0])


def bare_tenant(key: bytes) -> str:
    return "key-" + hashlib.sha256(key).hexdigest()[:8]


def parse_keys(text: str, source: str = "the API key file") -> ApiKeys:
    """The keys of a key file's text; InvalidRequest naming the line when a line is
    malformed, a key is used twice, or a tenant named twice."""
    entries: list[tuple[bytes, str]] = []
    limits: list[tuple[str, TenantLimits]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        found: dict[str, int] = {}
        while len(fields) > 1 and _is_limit(fields[-1]):
            name, _, value = fields.pop().partition("=")
            if name in found:
                raise InvalidRequest(f"{source}, line {number}: {name} is given twice")
            if not value.isdigit() or int(value) < 1:
                raise InvalidRequest(
                    f"{source}, line {number}: {name}={value} must be a whole number >= 1"
                )
            found[name] = int(value)
        if len(fields) == 1:
            key = fields[0].encode()
            tenant = bare_tenant(key)
        elif len(fields) == 2:
            tenant, key = fields[0], fields[1].encode()
            if not TENANT_NAME.match(tenant):
                raise InvalidRequest(
                    f"{source}, line {number}: tenant name {tenant!r} must be 1-64 letters, "
                    "digits and _.@- (starting with a letter or digit)"
                )
        else:
            raise InvalidRequest(
                f"{source}, line {number}: expected 'KEY' or 'NAME KEY' (then optionally "
                f"limits: {', '.join(n + '=N' for n in LIMIT_NAMES)}), got {len(fields)} fields"
            )
        if any(key == old for old, _ in entries):
            raise InvalidRequest(f"{source}, line {number}: this key is already on an earlier line")
        if any(tenant == old for _, old in entries):
            raise InvalidRequest(f"{source}, line {number}: tenant {tenant!r} is named twice")
        entries.append((key, tenant))
        if found:
            limits.append((tenant, TenantLimits(**found)))
    if not entries:
        raise InvalidRequest(f"{source} holds no key")
    return ApiKeys(tuple(entries), tuple(limits))


class KeySource:
    """The keys in force: from a file (read again when it changes) or fixed."""

    def __init__(self, path: Path | None = None, fixed: ApiKeys | None = None) -> None:
        self.path = path.expanduser() if path is not None else None
        self._keys = fixed
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        if self.path is not None:
            self._keys = parse_keys(self.path.read_text(), str(self.path))
            self._stamp = self._file_stamp()

    @classmethod
    def configured(cls, key_file: Path | None) -> KeySource | None:
        """The source for ``--api-key-file`` (or ``MESH_API_KEY``); None without keys."""
        if key_file is not None:
            return cls(path=key_file)
        key = os.environ.get("MESH_API_KEY", "").strip()
        return key_source(key) if key else None

    def _file_stamp(self) -> tuple[int, int] | None:
        assert self.path is not None
        try:
            stat = self.path.stat()
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size

    def current(self) -> ApiKeys:
        """The keys now; a changed file is read again (at most once a second)."""
        if self.path is None:
            assert self._keys is not None
            return self._keys
        now = time.monotonic()
        with self._lock:
            if now - self._checked >= RECHECK_S:
                self._checked = now
                stamp = self._file_stamp()
                if stamp is not None and stamp != self._stamp:
                    self._stamp = stamp
                    self._reload()
            assert self._keys is not None
            return self._keys

    def _reload(self) -> None:
        assert self.path is not None
        try:
            keys = parse_keys(self.path.read_text(), str(self.path))
        except (OSError, UnicodeDecodeError, InvalidRequest) as error:
            message = getattr(error, "message", None) or str(error)
            logger.error("API keys not reloaded, the previous ones stay in force: %s", message)
            return
        logger.info("API keys reloaded from %s: %d tenant(s)", self.path, len(keys.entries))
        self._keys = keys

    def tenant_of(self, given: bytes) -> str | None:
        return self.current().tenant_of(given)

    def limit_of(self, tenant: str) -> int | None:
        return self.current().limit_of(tenant)

    def limits_of(self, tenant: str) -> TenantLimits:
        return self.current().limits_of(tenant)


def _is_limit(field: str) -> bool:
    return field.partition("=")[0] in LIMIT_NAMES and "=" in field


def presented_keys(headers: Mapping[str, str]) -> tuple[bytes, ...]:
    """The keys a request presents: ``x-api-key`` (Anthropic clients) and
    ``Authorization: Bearer`` (OpenAI clients), each once; empty when none."""
    keys: list[bytes] = []
    if "x-api-key" in headers:
        keys.append(headers["x-api-key"].strip().encode("utf-8", "surrogateescape"))
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        bearer = token.strip().encode("utf-8", "surrogateescape")
        if bearer not in keys:
            keys.append(bearer)
    return tuple(keys)


def request_tenant(source: KeySource, headers: Mapping[str, str]) -> str | None:
    """The tenant whose key a request presents; None without a valid one. A request
    that sends both headers is taken when the valid keys among them are one
    tenant's (a stale or injected second header does not turn a valid key away),
    and refused when they name two tenants."""
    tenants = {source.tenant_of(key) for key in presented_keys(headers)} - {None}
    return tenants.pop() if len(tenants) == 1 else None


def key_source(keys: KeySource | str | None) -> KeySource | None:
    """A source from what a caller gives: a source, one key, or none."""
    if keys is None or isinstance(keys, KeySource):
        return keys
    return KeySource(fixed=ApiKeys(((keys.encode(), bare_tenant(keys.encode())),)))
