import itertools
import math

import pytest

from laneplay.evals.passk import KS, OUTCOMES, count_statuses, mean_pass_at_ks, pass_at_k, pass_at_ks


def brute_force(n, c, k):
    """Fraction of k-subsets of n samples (c of them correct) that contain a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_matches_combinatorics_for_all_small_pools():
    for n in range(1, 17):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)


def test_matches_subset_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12), (n, c, k)


def test_edges_and_large_n():
    assert pass_at_k(16, 0, 1) == 0.0
    assert pass_at_k(16, 16, 16) == 1.0
    assert pass_at_k(16, 1, 16) == 1.0  # n - c < k
    assert pass_at_k(16, 4, 1) == pytest.approx(0.25)
    assert 0.0 < pass_at_k(10_000, 3, 100) < 1.0  # no overflow where C(n, k) would be huge
    import numpy as np

    assert pass_at_k(np.int64(4), np.int64(2), 1) == 0.5  # counts computed with numpy are fine


@pytest.mark.parametrize("n,c,k,exc", [(0, 0, 1, ValueError), (4, 5, 1, ValueError), (4, -1, 1, ValueError),
                                       (4, 2, 0, ValueError), (4, 2, 5, ValueError), (4.0, 2, 1, TypeError),
                                       (4, True, 1, TypeError)])
def test_rejects_bad_arguments(n, c, k, exc):
    with pytest.raises(exc):
        pass_at_k(n, c, k)


def test_tables():
    assert list(pass_at_ks(16, 3)) == list(KS)
    assert list(pass_at_ks(5, 3)) == [1, 2, 4]  # only k <= n
    table = mean_pass_at_ks([(4, 0), (4, 4), (4, 2)])
    assert list(table) == [1, 2, 4]
    assert table[1] == pytest.approx((0 + 1 + 0.5) / 3)
    assert table[4] == pytest.approx(2 / 3)
    assert mean_pass_at_ks([]) == {}
    assert count_statuses(["pass", "fail", "pass", "timeout"]) == \
        {"pass": 2, "fail": 1, "timeout": 1, "memory": 0, "error": 0}
    assert set(OUTCOMES) == {"pass", "fail", "timeout", "memory", "error"}
    with pytest.raises(ValueError):
        count_statuses(["weird"])
