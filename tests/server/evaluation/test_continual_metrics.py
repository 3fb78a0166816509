"""AP, F.Ra, FWT, BWT on small matrices computed by hand."""

from __future__ import annotations

import pytest

from skillpool.server.evaluation.continual_metrics import ap_curve, auto_vs_forced, cl_metrics

# a[j][i]: task i after training task j
M = [
    [80.0, None, None],
    [70.0, 60.0, None],
    [50.0, 65.0, 90.0],
]


def test_metrics_match_the_definitions() -> None:
    m = cl_metrics(M, single=[75.0, 70.0, 85.0])
    assert m["AP"] == pytest.approx((50 + 65 + 90) / 3)
    # F.Ra: task 0 peaked at 80 (max over j < T-1), ends at 50 -> 30; task 1 peaked at 60, ends at 65 -> -5
    assert m["F.Ra"] == pytest.approx((30 - 5) / 2)
    # BWT: (50 - 80) and (65 - 60)
    assert m["BWT"] == pytest.approx((-30 + 5) / 2)
    # FWT: diagonal against trained-alone: (80-75) + (60-70) + (90-85)
    assert m["FWT"] == pytest.approx((5 - 10 + 5) / 3)


def test_no_forgetting_and_undefined_values() -> None:
    flat = [[70.0, None], [70.0, 80.0]]
    m = cl_metrics(flat)
    assert m["F.Ra"] == 0 and m["BWT"] == 0 and m["FWT"] is None
    one = cl_metrics([[42.0]], single=[40.0])
    assert one["AP"] == 42 and one["F.Ra"] is None and one["BWT"] is None and one["FWT"] == pytest.approx(2.0)


def test_last_row_only_gives_ap_only() -> None:
    m = cl_metrics([[None, None], [60.0, 80.0]], single=[1.0, 2.0])
    assert m == {"AP": 70.0, "F.Ra": None, "FWT": None, "BWT": None}


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="T x T"):
        cl_metrics([[1.0, 2.0]])
    with pytest.raises(ValueError, match="last row"):
        cl_metrics([[1.0, None], [2.0, None]])
    with pytest.raises(ValueError, match="single-task"):
        cl_metrics(M, single=[1.0])


def test_ap_curve() -> None:
    assert ap_curve(M) == [80.0, 65.0, pytest.approx(205 / 3)]
    assert ap_curve([[None, None], [1.0, 3.0]]) == [None, 2.0]


def test_auto_vs_forced_is_the_final_rows_difference() -> None:
    auto = [[70.0, None], [66.0, 52.0]]
    forced = [[72.0, None], [72.0, 50.0]]  # a forced block is frozen: its column repeats
    assert auto_vs_forced(auto, forced) == [-6.0, 2.0]
    with pytest.raises(ValueError):
        auto_vs_forced([[70.0, None], [66.0, None]], forced)
