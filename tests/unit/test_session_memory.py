"""A session's KV when the allocator runs out (mesh/runtime/sessions.py): a buffer
that would double is grown to what the frame needs instead, kept prefixes make way,
and a session that cannot fit even alone is refused for good (InvalidRequest, a 400),
not with a retry-later CapacityExceeded (a 429 it would get for ever)."""

from __future__ import annotations

import pytest
import torch

from mesh.errors import CapacityExceeded, InvalidRequest
from mesh.runtime import sessions
from mesh.runtime.sessions import KVLayout, SessionTable

LAYOUT = KVLayout(0, 2, 2, 8, torch.float32, torch.device("cpu"))


@pytest.fixture
def memory_for(monkeypatch: pytest.MonkeyPatch):
    """``memory_for(table, positions)``: allocations of KV buffers fail once the
    buffers ``table`` holds (its sessions' and kept prefixes', the old buffer of one
    being grown included) and the new one would pass ``positions`` in all, as a
    process under its memory limit sees it."""
    watched: list[tuple[SessionTable, int]] = []
    real_zeros = torch.zeros

    def zeros(*shape, **kwargs):
        if len(shape) == 1 and isinstance(shape[0], tuple) and len(shape[0]) == 6 and watched:
            sessions_, limit = watched[0]
            held = sum(c.capacity for c in sessions_._sessions.values())
            held += sum(c.capacity for c in sessions_._prefixes.values())
            if held + shape[0][4] > limit:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to")
        return real_zeros(*shape, **kwargs)

    monkeypatch.setattr(sessions.torch, "zeros", zeros)

    def set_limit(sessions_: SessionTable, positions: int) -> SessionTable:
        watched[:] = [(sessions_, positions)]
        return sessions_

    return set_limit


def table() -> SessionTable:
    return SessionTable(LAYOUT, max_sessions=8, max_tokens_per_session=8192, prefix_bytes=1 << 30)


def test_a_session_that_cannot_fit_even_alone_is_refused_for_good(memory_for) -> None:
    sessions_ = memory_for(table(), 1024)
    with pytest.raises(InvalidRequest, match="even with no other session"):
        sessions_.open_for_frame("big", 0, 2000)
    # One that fits is served.
    assert sessions_.open_for_frame("small", 0, 300).capacity >= 300


def test_with_other_sessions_holding_kv_it_is_a_retry_later(memory_for) -> None:
    sessions_ = memory_for(table(), 1024)
    sessions_.open_for_frame("a", 0, 700).commit(700)
    with pytest.raises(CapacityExceeded):
        sessions_.open_for_frame("b", 0, 600)
    sessions_.drop("a")
    assert sessions_.open_for_frame("b", 0, 600).capacity >= 600


def test_a_buffer_that_would_double_grows_only_to_what_the_frame_needs(memory_for) -> None:
    # The old buffer and the new one are alive together while the KV is copied.
    sessions_ = memory_for(table(), 1024 + 1280)
    cache = sessions_.open_for_frame("s", 0, 1024)
    cache.commit(1024)
    assert cache.capacity == 1024
    grown = sessions_.open_for_frame("s", 1024, 76)  # doubling would take 2048
    assert grown.capacity == 1280


def test_kept_prefixes_make_way_for_a_live_session(memory_for) -> None:
    sessions_ = memory_for(table(), 1024)
    sessions_.open_for_frame("done", 0, 700).commit(700)
    assert sessions_.keep_prefix("done", 700)
    assert sessions_.open_for_frame("next", 0, 600).capacity >= 600
    assert "done" not in sessions_.prefixes()
