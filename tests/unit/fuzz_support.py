"""Hypothesis strategies the HTTP fuzz tests share: any JSON value, weighted toward
the values (``samples``) that come close to valid for the routes under test."""

from __future__ import annotations

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
