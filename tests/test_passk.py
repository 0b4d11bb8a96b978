"""pass@k against brute-force enumeration of every k-subset."""

import itertools
import math
import random

import pytest

from asyncrl.tasks.passk import pass_at_k, summarize_rewards


def brute_force(correct: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 11))
def test_matches_brute_force_for_every_c_and_k(n):
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force(correct, k), abs=1e-12)


def test_large_n_is_stable_where_binomials_overflow_floats():
    n, c, k = 2000, 3, 500
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # exact integers, one rounding at the end
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    with pytest.raises(OverflowError):  # the naive float formula cannot even be evaluated here
        float(math.comb(n, k))
    assert pass_at_k(n, 0, k) == 0.0 and pass_at_k(n, n, 1) == 1.0


def test_edge_cases_and_errors():
    assert pass_at_k(5, 1, 1) == pytest.approx(0.2)
    assert pass_at_k(5, 2, 4) == 1.0  # fewer wrong samples than k: some pick is always right
    for bad in [(3, 4, 1), (3, 1, 0), (3, 1, 4), (3, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_summary_averages_over_prompts_and_reports_every_k():
    rng = random.Random(0)
    groups = [[float(rng.random() < p) for _ in range(6)] for p in (0.1, 0.5, 0.9, 0.0)]
    groups[0][0] = 0.5  # partial credit counts toward mean reward but is not a pass
    out = summarize_rewards(groups)
    assert set(out) == {"mean_reward", "num_prompts"} | {f"pass@{k}" for k in range(1, 7)}
    assert out["mean_reward"] == pytest.approx(sum(sum(g) / 6 for g in groups) / 4)
    for k in range(1, 7):
        expect = sum(brute_force([r >= 1.0 for r in g], k) for g in groups) / 4
        assert out[f"pass@{k}"] == pytest.approx(expect)
    assert out["pass@1"] <= out["pass@3"] <= out["pass@6"]


def test_summary_with_unequal_group_sizes_stops_at_the_smallest():
    out = summarize_rewards([[1.0, 0.0, 0.0], [0.0, 1.0]])
    assert "pass@2" in out and "pass@3" not in out
    assert out["pass@1"] == pytest.approx((1 / 3 + 1 / 2) / 2)
    with pytest.raises(ValueError):
        summarize_rewards([[1.0], []])
