"""Hypothesis strategies the HTTP fuzz tests share: any JSON value, weighted toward
the values (``samples``) that come close to valid for the routes under test."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st


def json_values(samples: Sequence[Any]) -> st.SearchStrategy[Any]:
    """Scalars (with ``samples`` among them) and small lists and objects of them."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=12),
        st.sampled_from(list(samples)),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=12,
    )


def token_budget(raw: bytes, names: Sequence[str], default: int) -> int:
    """The most tokens a served body may have per choice: the largest positive
    integer it gives any of ``names`` (the budget fields of its route), else the
    server's ``default``."""
    sent = json.loads(raw)
    values = [sent.get(name) for name in names] if isinstance(sent, dict) else []
    given = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return max(given, default=default)
