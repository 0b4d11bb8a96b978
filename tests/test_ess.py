"""Measured staleness (`train/ess.py`): per-group importance-weight sums, Kish ESS, k3, and their lag buckets, on
arrays whose values are worked out by hand in the comments."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.train.batch import combine_host_metrics
from asyncrl.train.ess import batch_ess, group_staleness, group_weight_sums, kish_ess, lag_means, lag_sums

L2 = math.log(2.0)


def test_group_sums_ess_and_k3_by_hand():
    # Row 0 (group 0): log w = [log 2, 0, -log 2] -> w = [2, 1, 0.5]; k3 = w - 1 - log w = [1 - log 2, 0, log 2 - 0.5].
    # Row 1 (group 0): one model token with w = 1; its second position is forced (off the mask) and holds garbage.
    # Row 2 (group 1): no model token at all.
    prox = jnp.array([[L2, 0.0, -L2], [-1.0, 500.0, 0.0], [3.0, 3.0, 3.0]], jnp.float32)
    sampler = jnp.zeros((3, 3), jnp.float32).at[1, 0].set(-1.0)
    mask = jnp.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], bool)
    sums = np.asarray(group_weight_sums(prox, sampler, mask, jnp.array([0, 0, 1], jnp.int32), 3))
    # Group 0: sum w = 3.5 + 1, sum w^2 = 4 + 1 + 0.25 + 1, n = 4, sum k3 = (1 - log 2) + (log 2 - 0.5) = 0.5.
    np.testing.assert_allclose(sums, [[4.5, 6.25, 4.0, 0.5], [0, 0, 0, 0], [0, 0, 0, 0]], rtol=1e-6, atol=1e-6)
    ess, k3 = group_staleness(sums)
    # ESS = 4.5^2 / (4 x 6.25) = 0.81; a group without tokens counts as fully effective (nothing to discount).
    np.testing.assert_allclose(ess, [0.81, 1.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(k3, [0.125, 0.0, 0.0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(batch_ess(jnp.asarray(sums))), 0.81, rtol=1e-6)


def test_kish_ess_limits():
    # Equal weights: 1. One token of n carrying all the weight: 1/n.
    assert kish_ess(np.float64(5.0), np.float64(5.0), np.float64(5.0)) == 1.0
    assert kish_ess(np.float64(10.0), np.float64(100.0), np.float64(4.0)) == pytest.approx(0.25)
    assert float(kish_ess(jnp.float32(10.0), jnp.float32(100.0), jnp.float32(4.0))) == pytest.approx(0.25)


def test_huge_log_weights_stay_finite():
    sums = np.asarray(group_weight_sums(jnp.array([[200.0, 0.0]]), jnp.zeros((1, 2)), jnp.ones((1, 2), bool),
                                       jnp.zeros(1, jnp.int32), 1))
    assert np.isfinite(sums).all()
    ess, _ = group_staleness(sums)
    assert ess[0] == pytest.approx(0.5, rel=1e-6)  # one token of two carries the group: 1/n


def test_lag_buckets_and_their_combination_over_hosts():
    host_a = lag_sums([0.81, 1.0, 0.5], [0.125, 0.0, 0.3], [0, 1, 1], max_lag=2)
    assert host_a == {"staleness/groups": 3.0, "staleness/ess_total": pytest.approx(2.31),
                      "staleness/k3_total": pytest.approx(0.425), "staleness/ess_min": 0.5,
                      "staleness/groups_lag0": 1.0, "staleness/ess_total_lag0": pytest.approx(0.81),
                      "staleness/groups_lag1": 2.0, "staleness/ess_total_lag1": 1.5,
                      "staleness/groups_lag2": 0.0, "staleness/ess_total_lag2": 0.0}
    row, by_lag = lag_means(host_a, 2)
    assert by_lag == {0: pytest.approx(0.81), 1: 0.75}  # lag 2 had no group: no figure, not a zero
    assert row["staleness/ess_mean"] == pytest.approx(0.77) and row["staleness/k3_mean"] == pytest.approx(0.425 / 3)
    assert "staleness/ess_lag2" not in row and row["staleness/ess_lag1"] == 0.75
    # A second host's groups: sums add, the minimum is the smaller, the means are over every group.
    host_b = lag_sums([0.2], [1.0], [2], max_lag=2)
    row, by_lag = lag_means(combine_host_metrics([host_a, host_b]), 2)
    assert by_lag == {0: pytest.approx(0.81), 1: 0.75, 2: pytest.approx(0.2)}
    assert row["staleness/ess_min"] == pytest.approx(0.2) and row["staleness/ess_mean"] == pytest.approx(2.51 / 4)
