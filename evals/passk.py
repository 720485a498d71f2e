"""pass@k: the unbiased estimator of the Codex paper, and the tables built from it."""
from __future__ import annotations

import math
import numbers
from collections import Counter
from collections.abc import Iterable, Sequence

KS = (1, 2, 4, 8, 16)
OUTCOMES = ("pass", "fail", "timeout", "memory", "error")  # how one sample can end


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n, of which c are correct, passes).

    1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i) to stay stable for large n.
    """
    for name, v in (("n", n), ("c", c), ("k", k)):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    n, c, k = int(n), int(c), int(k)
    if n < 1:
        raise ValueError(f"n must be >= 1 (got {n})")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}] (got {c})")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}] (got {k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_ks(n: int, c: int, ks: Iterable[int] = KS) -> dict[int, float]:
    """pass@k for each k <= n, all from the same pool of n samples."""
    return {k: pass_at_k(n, c, k) for k in ks if k <= n}


def mean_pass_at_ks(pools: Sequence[tuple[int, int]], ks: Iterable[int] = KS) -> dict[int, float]:
    """Mean over problems of pass@k, given (n, c) per problem; only k <= the smallest n."""
    if not pools:
        return {}
    n_min = min(n for n, _ in pools)
    return {k: sum(pass_at_k(n, c, k) for n, c in pools) / len(pools) for k in ks if k <= n_min}


def count_statuses(statuses: Iterable[str]) -> dict[str, int]:
    """How many samples ended in each outcome; every outcome is present (0 when none)."""
    counts = Counter(statuses)
    unknown = set(counts) - set(OUTCOMES)
    if unknown:
        raise ValueError(f"unknown status(es): {sorted(unknown)}")
    return {s: counts.get(s, 0) for s in OUTCOMES}
