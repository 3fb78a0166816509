"""AP, F.Ra, FWT, BWT on small matrices computed by hand."""

from __future__ import annotations

import pytest

from skillpool.evaluation.continual_metrics import (
    ap_curve,
    ap_interval,
    auto_vs_forced,
    cl_metrics,
    fwt_interval,
    row_mean,
)

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


def coin_rows(n: int, right: int) -> list[float]:
    """n exact-match rows, the first `right` of them answered right (100 points)."""
    return [100.0] * right + [0.0] * (n - right)


def test_ap_interval_is_the_binomial_width_and_narrows_with_more_rows() -> None:
    lo, hi = ap_interval([coin_rows(400, 200)])
    # half right of 400: standard error 100 * sqrt(0.25 / 400) = 2.5 points, a 95% interval of about ±4.9
    assert lo < 50 < hi and 9.0 < hi - lo < 10.6
    lo50, hi50 = ap_interval([coin_rows(50, 25)])
    assert hi50 - lo50 > 2.5 * (hi - lo)  # sqrt(400 / 50) = 2.8 times wider
    # AP averages tasks: two tasks of 400 rows each are as noisy as one of 800, not of 400
    lo2, hi2 = ap_interval([coin_rows(400, 200), coin_rows(400, 200)])
    assert hi2 - lo2 < 0.8 * (hi - lo)
    assert ap_interval([coin_rows(20, 20), coin_rows(30, 0)]) == (50.0, 50.0)  # no spread: no width


def test_a_paired_interval_sees_through_shared_rows() -> None:
    a = [coin_rows(50, 25), coin_rows(50, 30)]
    assert ap_interval(a, a) == (0.0, 0.0)
    # ROUGE-like scores, every row 10 points higher: 10 more whatever rows are drawn
    graded = [[float(v) for v in range(0, 90, 3)]]
    assert ap_interval([[v + 10 for v in graded[0]]], graded) == (pytest.approx(10.0), pytest.approx(10.0))
    # b answers a's right rows right and 5 more of each task's: the paired interval holds only those rows'
    # spread, so it is narrower than either AP's own interval, which overlap widely
    b = [coin_rows(50, 30), coin_rows(50, 35)]
    assert row_mean(b[0]) - row_mean(a[0]) == 10.0
    lo, hi = ap_interval(b, a)
    (alo, ahi), blo = ap_interval(a), ap_interval(b)[0]
    assert 0 < lo < 10 < hi and hi - lo < 0.7 * (ahi - alo)
    assert blo < ahi  # unpaired, 10 points apart is no evidence at 50 rows


def test_ap_interval_refuses_rows_that_do_not_pair() -> None:
    with pytest.raises(ValueError, match="same rows on both sides"):
        ap_interval([coin_rows(10, 5)], [coin_rows(9, 5)])
    with pytest.raises(ValueError, match="at least one scored row"):
        ap_interval([[]])
    with pytest.raises(ValueError, match="level"):
        ap_interval([coin_rows(4, 2)], level=1.0)


def test_fwt_interval_is_paired_on_the_diagonal_against_trained_alone() -> None:
    single = [coin_rows(50, 20), coin_rows(50, 40), coin_rows(50, 10)]
    # each task, learned in turn, answers its trained-alone right rows right and 5 more: FWT +10 on every draw
    diagonal = [coin_rows(50, 25), coin_rows(50, 45), coin_rows(50, 15)]
    matrix = [
        [row_mean(diagonal[0]), None, None],
        [0.0, row_mean(diagonal[1]), None],
        [0.0, 0.0, row_mean(diagonal[2])],
    ]
    fwt = cl_metrics(matrix, [row_mean(r) for r in single])["FWT"]
    lo, hi = fwt_interval(diagonal, single)
    assert fwt == pytest.approx(10.0) and 0 < lo < fwt < hi < 20
    assert fwt_interval(single, single) == (0.0, 0.0)  # no transfer: no width
    # rows that disagree both ways: the same mean difference, an interval through 0
    swapped = [r[::-1] for r in single]
    lo, hi = fwt_interval(swapped, single)
    assert lo < 0 < hi
    with pytest.raises(ValueError, match="same rows on both sides"):
        fwt_interval(diagonal, [coin_rows(49, 20), *single[1:]])
