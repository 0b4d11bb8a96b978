"""Measured staleness: how far the policy the trainer holds has moved from the one that sampled each group.

The importance weight of a model token is w = pi_prox / pi_sampler, where pi_prox is the proximal policy (the
trainer's params before the step's first update: decoupled PPO, `train/step.py`) and pi_sampler the logprob the
inference engine recorded. Forced tokens (environment observations, forced text) and padding are off the mask.
Per group (one prompt's completions) the step sums, over its model tokens:

    [sum w, sum w^2, n, sum k3],   k3 = w - 1 - log w

k3 is Schulman's estimator of KL(pi_sampler || pi_prox) from the sampler's own samples (unbiased, >= 0). The
sums add across micro-batches, mini-batches and devices, so the step returns them summed, [n_groups, 4]; the host
turns them into each group's Kish effective sample size as a fraction of its tokens, (sum w)^2 / (n sum w^2) (1
when every weight is equal, 1/n when one token carries the group), and its mean k3. Tied to the group's lag
(trainer version minus the oldest weights behind any of its tokens), they show how ESS falls with lag in this run:
the signal `async.admission: adaptive` releases prompts by (`orchestration/staleness.py`), and the factor
`train.ess_scaled_lr` scales each update by (VCPO, arXiv 2602.17616).

The weights here are the raw ones: the correction's `is_ess` (`correction.py`) is the ESS of the weights the loss
applied, after truncation or masking.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Columns of the per-group sums.
W_SUM, W_SQ_SUM, COUNT, K3_SUM = range(4)
# exp() of a log-weight is taken at most e^30 (~1e13): past it the ESS of the group is ~1/n either way, and w^2
# stays finite in float32.
_MAX_LOG_WEIGHT = 30.0


def group_weight_sums(lp_prox: jax.Array, lp_sampler: jax.Array, mask: jax.Array, group_ids: jax.Array,
                      n_groups: int) -> jax.Array:
    """[n_groups, 4] float32: per group, [sum w, sum w^2, token count, sum k3] over its masked tokens.

    lp_prox, lp_sampler [B, T] float; mask [B, T] bool; group_ids [B] int in [0, n_groups). Detached."""
    sg = jax.lax.stop_gradient
    m = mask.astype(bool)
    log_w = jnp.minimum(jnp.where(m, sg(lp_prox).astype(jnp.float32) - sg(lp_sampler).astype(jnp.float32), 0.0),
                        _MAX_LOG_WEIGHT)  # [B, T]
    w = jnp.exp(log_w)
    mf = m.astype(jnp.float32)
    rows = jnp.stack([jnp.sum(w * mf, 1), jnp.sum(w * w * mf, 1), jnp.sum(mf, 1),
                      jnp.sum((w - 1.0 - log_w) * mf, 1)], axis=-1)  # [B, 4]
    # A one-hot reduction over rows rather than a scatter: rows may be split over the data axes, and a sum over a
    # sharded dim is a plain all-reduce under explicit sharding ([B, n_groups] is small: n_groups <= B).
    onehot = (group_ids[:, None] == jnp.arange(n_groups, dtype=group_ids.dtype)[None, :]).astype(jnp.float32)
    return jnp.sum(onehot[:, :, None] * rows[:, None, :], axis=0)  # [n_groups, 4]


def kish_ess(w_sum: jax.Array | np.ndarray, w_sq_sum: jax.Array | np.ndarray,
             count: jax.Array | np.ndarray) -> jax.Array | np.ndarray:
    """(sum w)^2 / (n sum w^2), the Kish effective sample size as a fraction of n; 1 where there are no tokens
    (nothing to discount). Works on numpy and jax arrays alike."""
    xp = jnp if isinstance(w_sum, jax.Array) else np
    ok = (count > 0) & (w_sq_sum > 0)
    return xp.where(ok, w_sum * w_sum / xp.where(ok, count * w_sq_sum, 1.0), 1.0)


def batch_ess(sums: jax.Array) -> jax.Array:
    """The Kish ESS fraction of every token in `sums` ([n_groups, 4], or [4]) taken together."""
    total = jnp.sum(sums.reshape(-1, 4), axis=0)
    return kish_ess(total[W_SUM], total[W_SQ_SUM], total[COUNT])


def group_staleness(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[G, 4] sums -> (ESS fraction [G], mean k3 per token [G]) per group."""
    sums = np.asarray(sums, np.float64)
    ess = kish_ess(sums[:, W_SUM], sums[:, W_SQ_SUM], sums[:, COUNT])
    k3 = np.where(sums[:, COUNT] > 0, sums[:, K3_SUM] / np.maximum(sums[:, COUNT], 1.0), 0.0)
    return ess, k3


def lag_sums(ess: Sequence[float], k3: Sequence[float], lags: Sequence[int], max_lag: int) -> dict[str, float]:
    """The step's groups as summable host metrics with a fixed key set (trainer hosts add them by key,
    `batch.combine_host_metrics`): per lag 0..max_lag the group count and ESS sum, and over all groups the count,
    the sums of ESS and k3 and the smallest ESS."""
    ess, k3, lags = np.asarray(ess, np.float64), np.asarray(k3, np.float64), np.asarray(lags, np.int64)
    out = {"staleness/groups": float(len(ess)), "staleness/ess_total": float(ess.sum()),
           "staleness/k3_total": float(k3.sum()), "staleness/ess_min": float(ess.min()) if len(ess) else 1.0}
    for lag in range(max_lag + 1):
        at = lags == lag
        out[f"staleness/groups_lag{lag}"] = float(at.sum())
        out[f"staleness/ess_total_lag{lag}"] = float(ess[at].sum())
    return out


def lag_means(sums: dict[str, float], max_lag: int) -> tuple[dict[str, float], dict[int, float]]:
    """`lag_sums` (combined over hosts) -> (the logged row: mean ESS and k3 over groups, smallest ESS, and the mean
    ESS of each lag that had groups, `staleness/ess_lag{L}`, with its group count), and {lag: mean ESS}."""
    n = max(sums["staleness/groups"], 1.0)
    row = {"staleness/ess_mean": sums["staleness/ess_total"] / n, "staleness/k3_mean": sums["staleness/k3_total"] / n,
           "staleness/ess_min": sums["staleness/ess_min"]}
    by_lag: dict[int, float] = {}
    for lag in range(max_lag + 1):
        count = sums[f"staleness/groups_lag{lag}"]
        row[f"staleness/groups_lag{lag}"] = count
        if count > 0:
            by_lag[lag] = sums[f"staleness/ess_total_lag{lag}"] / count
            row[f"staleness/ess_lag{lag}"] = by_lag[lag]
    return row, by_lag
