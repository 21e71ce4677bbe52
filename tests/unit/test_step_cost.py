"""The rule that decides whether a draft row pays in a batched step."""

from __future__ import annotations

import pytest

from stage.frontend.step_cost import StepCostFit, acceptance, paying_window, row_threshold


def test_the_fit_recovers_fixed_and_per_row_cost() -> None:
    fit = StepCostFit()
    assert fit.model() is None
    for rows in (1, 4, 8, 16, 1, 2, 32, 8):
        fit.observe(rows, 6.0 + 1.5 * rows)
    fixed, per_row = fit.model()
    assert fixed == pytest.approx(6.0) and per_row == pytest.approx(1.5)


def test_a_fit_needs_rows_that_vary() -> None:
    fit = StepCostFit()
    for _ in range(10):
        fit.observe(4, 20.0)
    assert fit.model() is None


def test_drafts_pay_alone_and_stop_paying_in_a_big_step() -> None:
    # A frame that costs mostly the same whatever its rows (a GEMV-bound step).
    cheap_rows = (40.0, 0.5)
    # A frame whose kernels grow with every row (the int4 kernel on this CPU).
    costly_rows = (6.0, 1.7)
    assert row_threshold(cheap_rows, 1) < 0.02
    assert row_threshold(costly_rows, 1) == pytest.approx(1.7 / 7.7)
    assert row_threshold(costly_rows, 8) == pytest.approx(8 * 1.7 / (6.0 + 13.6))
    # A 0.7-acceptance request keeps a long window alone (0.7 ** 12 > 1/81), a short
    # one alone on costly rows, one row among 8 costly rows, none at 0.6.
    assert paying_window(0.7, row_threshold(cheap_rows, 1), 16) == 12
    assert paying_window(0.7, row_threshold(costly_rows, 1), 16) == 4
    assert paying_window(0.7, row_threshold(costly_rows, 8), 16) == 1
    assert paying_window(0.6, row_threshold(costly_rows, 8), 16) == 0
    # A nearly sure draft (copying a file being edited) still pays there.
    assert paying_window(0.97, row_threshold(costly_rows, 8), 16) == 11


def test_paying_window_edges() -> None:
    assert paying_window(0.9, 0.0, 8) == 8  # nothing measured yet
    assert paying_window(1.0, 0.5, 8) == 8
    assert paying_window(0.5, 0.5, 8) == 0
    assert paying_window(0.9, 0.5, 0) == 0
    assert acceptance(0, 0) == 0.5 and acceptance(8, 8) == pytest.approx(0.9)
