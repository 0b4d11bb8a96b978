"""RL policy-gradient losses as pure array functions, with their batch-level advantages and token weights.

Every loss has the signature of `LossFn` and is looked up by name (`get_loss(cfg.name)`). Inputs per micro-batch:
`logprobs` [B, T] (trainer, differentiated), `sampler_logprobs` [B, T] (what the inference engine recorded: the
behaviour policy), `advantages` [B], `weights` [B, T], `mask` [B, T]. Logprobs follow the temperature convention
of `asyncrl/train/logprobs.py`.

Advantages and weights are computed once per step on the FULL batch (`prepare_loss_inputs`), before it is split
into micro-batches: groups and normalisers must not depend on how the batch is split. The loss is then
`sum(weights * per_token_objective)`, so the sum of micro-batch losses (and gradients) equals the full-batch loss.

| name    | advantage                        | default normalisation: weight of a kept token          |
|---------|----------------------------------|--------------------------------------------------------|
| grpo    | (r - mean_g) / (std_g + std_eps) | seq_mean:   1 / (len_i * B)   (mean of sequence means) |
| dapo    | (r - mean_g) / (std_g + std_eps) | token_mean: 1 / total_tokens                           |
| dr_grpo | r - mean_g                       | constant:   1 / (B * T_max)   (length-unbiased)        |
| cispo   | r - mean_g                       | token_mean: 1 / total_tokens                           |
| rloo    | r - (sum_g - r) / (G - 1)        | seq_mean:   1 / (len_i * B)                            |

std_g is the unbiased group std (as `torch.std` in TRL and verl). B counts kept sequences (seq_mean: those with
at least one loss token), T_max is `cfg.max_tokens` or the padded length. `cfg.normalization` overrides the column.

Per-token objectives (minimised), with ratio r = exp(lp - lp_old) and A the sequence's advantage:
- grpo, dapo, dr_grpo, rloo: PPO clip, -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A).
- cispo: -sg(min(r, eps_high)) * A * lp (seed blog / MiniMax-M1; every token keeps its gradient).
Without TIS, lp_old is the sampler's logprob. With TIS (`cfg.tis_cap`), lp_old is the proximal policy (by default
the trainer's own detached logprobs, so r == 1 in value) and each token's objective is multiplied by the truncated
importance weight sg(min(exp(lp_old - lp_sampler), tis_cap)), which corrects trainer/sampler numerics mismatch.
With `cfg.kl_coef > 0`, kl_coef * sum(weights * k3) is added, k3 = exp(ref - lp) - (ref - lp) - 1.

Metrics are reducible across micro-batches and devices by key suffix: `*_min` by min, `*_max` by max, everything
else by sum. `reduce_metrics` applies that rule; `finalize_metrics` turns `<x>_sum` into the per-token mean `<x>`
and `<x>_tokens` into the fraction `<x>_frac`, both over `token_count`. Min/max over a batch without tokens are
+inf/-inf.
"""

from __future__ import annotations

import functools
from typing import Callable, Protocol

import jax
import jax.numpy as jnp

from asyncrl.train.loss_config import LossConfig

Metrics = dict[str, jax.Array]

ADVANTAGE_ESTIMATORS = {
    "grpo": "group_std",
    "dapo": "group_std",
    "dr_grpo": "group_mean",
    "cispo": "group_mean",
    "rloo": "leave_one_out",
}
DEFAULT_NORMALIZATION = {
    "grpo": "seq_mean",
    "rloo": "seq_mean",
    "dapo": "token_mean",
    "cispo": "token_mean",
    "dr_grpo": "constant",
}


class LossFn(Protocol):
    def __call__(
        self,
        logprobs: jax.Array,
        sampler_logprobs: jax.Array,
        advantages: jax.Array,
        weights: jax.Array,
        mask: jax.Array,
        cfg: LossConfig,
        ref_logprobs: jax.Array | None = None,
        *,
        prox_logprobs: jax.Array | None = None,
    ) -> tuple[jax.Array, Metrics]: ...


LOSSES: dict[str, LossFn] = {}


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Register a loss under `name` (the value of `loss.name`)."""

    def register(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is already registered")
        LOSSES[name] = fn
        return fn

    return register


def get_loss(name: str) -> LossFn:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; registered: {sorted(LOSSES)}")
    return LOSSES[name]


# ---------------------------------------------------------------------------------------------------------------
# Batch level: advantages and token weights.


def _same_group(group_ids: jax.Array) -> jax.Array:
    # A [B, B] comparison instead of segment sums: ids need not be dense, and B (sequences per step) is small.
    return group_ids[:, None] == group_ids[None, :]  # [B, B]


def group_stats(rewards: jax.Array, group_ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per sequence, the (mean, unbiased std, size) of its group's rewards; each [B]."""
    rewards = rewards.astype(jnp.float32)
    same = _same_group(group_ids).astype(jnp.float32)  # [B, B]
    # Elementwise sums, not `same @ rewards`: a TPU f32 matmul at default precision rounds through bf16.
    size = jnp.sum(same, axis=1)
    mean = jnp.sum(same * rewards[None, :], axis=1) / size
    sq = jnp.sum(same * (rewards[None, :] - mean[:, None]) ** 2, axis=1)
    std = jnp.sqrt(sq / jnp.maximum(size - 1.0, 1.0))
    return mean, std, size


def compute_advantages(rewards: jax.Array, group_ids: jax.Array, cfg: LossConfig) -> jax.Array:
    """Sequence advantages [B] from rewards [B] and group ids [B] (sequences sampled from the same prompt)."""
    rewards = rewards.astype(jnp.float32)
    mean, std, size = group_stats(rewards, group_ids)
    estimator = ADVANTAGE_ESTIMATORS[cfg.name]
    if estimator == "group_std":
        return (rewards - mean) / (std + cfg.std_eps)
    if estimator == "group_mean":
        return rewards - mean
    # Leave-one-out: r - mean of the others == G / (G - 1) * (r - mean); a singleton group has no baseline.
    return jnp.where(size > 1, (rewards - mean) * size / jnp.maximum(size - 1.0, 1.0), 0.0)


def keep_sequences(rewards: jax.Array, group_ids: jax.Array, cfg: LossConfig) -> jax.Array:
    """[B] bool: False for sequences of equal-reward groups when `cfg.filter_zero_variance`, else all True."""
    if not cfg.filter_zero_variance:
        return jnp.ones(rewards.shape, bool)
    same = _same_group(group_ids)
    hi = jnp.max(jnp.where(same, rewards[None, :], -jnp.inf), axis=1)
    lo = jnp.min(jnp.where(same, rewards[None, :], jnp.inf), axis=1)
    return hi > lo


def loss_weights(mask: jax.Array, cfg: LossConfig, keep: jax.Array | None = None) -> jax.Array:
    """Token weights [B, T] for the FULL batch; see the normalisation table in the module docstring."""
    m = mask.astype(jnp.float32)  # [B, T]
    if keep is not None:
        m = m * keep.astype(jnp.float32)[:, None]
    mode = cfg.normalization or DEFAULT_NORMALIZATION[cfg.name]
    if mode == "token_mean":
        return m / jnp.maximum(jnp.sum(m), 1.0)
    lengths = jnp.sum(m, axis=1)  # [B]
    if mode == "seq_mean":
        n_seqs = jnp.sum(lengths > 0)
        return m / (jnp.maximum(lengths, 1.0) * jnp.maximum(n_seqs, 1))[:, None]
    n_seqs = m.shape[0] if keep is None else jnp.sum(keep)
    t_max = cfg.max_tokens or m.shape[1]
    return m / (jnp.maximum(n_seqs, 1) * t_max)


def prepare_loss_inputs(
    rewards: jax.Array, group_ids: jax.Array, mask: jax.Array, cfg: LossConfig
) -> tuple[jax.Array, jax.Array]:
    """(advantages [B], weights [B, T]) for the full batch of one optimizer step."""
    keep = keep_sequences(rewards, group_ids, cfg)
    return compute_advantages(rewards, group_ids, cfg), loss_weights(mask, cfg, keep)


# ---------------------------------------------------------------------------------------------------------------
# Per micro-batch: the losses.


def _masked_diff(a: jax.Array, b: jax.Array, m: jax.Array) -> jax.Array:
    # Padding positions may hold -inf or garbage; exp() of those would turn 0 * inf into NaN in the loss.
    return jnp.where(m, a - b, 0.0)


def _objective(
    per_token: Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]],
    logprobs: jax.Array,
    sampler_logprobs: jax.Array,
    advantages: jax.Array,
    weights: jax.Array,
    mask: jax.Array,
    cfg: LossConfig,
    ref_logprobs: jax.Array | None,
    prox_logprobs: jax.Array | None,
) -> tuple[jax.Array, Metrics]:
    """Shared ratio / TIS / KL / metrics plumbing; `per_token(ratio, adv, lp) -> (objective, clipped)` [B, T]."""
    sg = jax.lax.stop_gradient
    m = mask.astype(bool)  # [B, T]
    mf = m.astype(jnp.float32)
    lp = logprobs.astype(jnp.float32)
    lp_sampler = sampler_logprobs.astype(jnp.float32)
    w = weights.astype(jnp.float32) * mf
    adv = advantages.astype(jnp.float32)[:, None]  # [B, 1]

    if cfg.tis_cap is None:
        lp_old = lp_sampler
    else:
        lp_old = sg(lp) if prox_logprobs is None else prox_logprobs.astype(jnp.float32)
    ratio = jnp.exp(_masked_diff(lp, lp_old, m))  # [B, T]
    objective, clipped = per_token(ratio, adv, lp)
    metrics: Metrics = {}
    if cfg.tis_cap is not None:
        raw = jnp.exp(_masked_diff(lp_old, lp_sampler, m))
        tis = sg(jnp.minimum(raw, cfg.tis_cap))
        objective = objective * tis
        metrics["tis_weight_sum"] = jnp.sum(tis * mf)
        metrics["tis_truncated_tokens"] = jnp.sum((raw > cfg.tis_cap) & m)
    pg_loss = jnp.sum(w * objective)
    loss = pg_loss

    if cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("loss.kl_coef > 0 needs ref_logprobs")
        d = _masked_diff(ref_logprobs.astype(jnp.float32), lp, m)
        k3 = jnp.exp(d) - d - 1.0  # [B, T]
        kl_loss = cfg.kl_coef * jnp.sum(w * k3)
        loss = loss + kl_loss
        metrics["kl_sum"] = jnp.sum(k3 * mf)
        metrics["kl_loss"] = kl_loss

    metrics |= {
        "loss": loss,
        "pg_loss": pg_loss,
        "token_count": jnp.sum(mf),
        "is_ratio_sum": jnp.sum(ratio * mf),
        "is_ratio_min": jnp.min(jnp.where(m, ratio, jnp.inf)),
        "is_ratio_max": jnp.max(jnp.where(m, ratio, -jnp.inf)),
        "clip_tokens": jnp.sum(clipped & m),
        "logprob_gap_sum": jnp.sum(jnp.abs(_masked_diff(lp_sampler, lp, m))),
    }
    return loss, {k: sg(v).astype(jnp.float32) for k, v in metrics.items()}


def _ppo_clip(cfg: LossConfig):
    lo, hi = 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high

    def per_token(ratio: jax.Array, adv: jax.Array, lp: jax.Array) -> tuple[jax.Array, jax.Array]:
        objective = -jnp.minimum(ratio * adv, jnp.clip(ratio, lo, hi) * adv)
        clipped = ((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo))  # tokens with no gradient
        return objective, clipped

    return per_token


def ppo_clip_loss(
    logprobs: jax.Array,
    sampler_logprobs: jax.Array,
    advantages: jax.Array,
    weights: jax.Array,
    mask: jax.Array,
    cfg: LossConfig,
    ref_logprobs: jax.Array | None = None,
    *,
    prox_logprobs: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """PPO clipped surrogate; grpo, dapo, dr_grpo and rloo differ only in advantages, weights and epsilons."""
    return _objective(
        _ppo_clip(cfg), logprobs, sampler_logprobs, advantages, weights, mask, cfg, ref_logprobs, prox_logprobs
    )


for _name in ("grpo", "dapo", "dr_grpo", "rloo"):
    register_loss(_name)(ppo_clip_loss)


@register_loss("cispo")
def cispo_loss(
    logprobs: jax.Array,
    sampler_logprobs: jax.Array,
    advantages: jax.Array,
    weights: jax.Array,
    mask: jax.Array,
    cfg: LossConfig,
    ref_logprobs: jax.Array | None = None,
    *,
    prox_logprobs: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """CISPO: REINFORCE with the importance weight capped at epsilon_high and detached."""

    def per_token(ratio: jax.Array, adv: jax.Array, lp: jax.Array) -> tuple[jax.Array, jax.Array]:
        capped = jax.lax.stop_gradient(jnp.minimum(ratio, cfg.epsilon_high))
        return -capped * adv * lp, ratio > cfg.epsilon_high

    return _objective(
        per_token, logprobs, sampler_logprobs, advantages, weights, mask, cfg, ref_logprobs, prox_logprobs
    )


# ---------------------------------------------------------------------------------------------------------------
# Metric reduction.


def metric_reduction(key: str) -> str:
    """'min', 'max' or 'sum': how metric `key` combines across micro-batches and devices (psum/pmin/pmax)."""
    if key.endswith("_min"):
        return "min"
    if key.endswith("_max"):
        return "max"
    return "sum"


_COMBINE = {"min": jnp.minimum, "max": jnp.maximum, "sum": jnp.add}


def reduce_metrics(metrics: list[Metrics]) -> Metrics:
    """Combine per-micro-batch metric dicts (same keys) into one, by the suffix rule."""
    if not metrics:
        raise ValueError("reduce_metrics needs at least one metrics dict")
    keys = set(metrics[0])
    for other in metrics[1:]:
        if set(other) != keys:
            raise ValueError(f"metric keys differ: {sorted(keys ^ set(other))}")
    return {k: functools.reduce(_COMBINE[metric_reduction(k)], [d[k] for d in metrics]) for k in metrics[0]}


def finalize_metrics(metrics: Metrics) -> Metrics:
    """Reduced sums -> loggable values: `<x>_sum` -> mean `<x>`, `<x>_tokens` -> `<x>_frac` over token_count."""
    count = jnp.maximum(metrics["token_count"], 1.0)
    out: Metrics = {}
    for k, v in metrics.items():
        if k.endswith("_sum"):
            out[k.removesuffix("_sum")] = v / count
        elif k.endswith("_tokens"):
            out[k.removesuffix("_tokens") + "_frac"] = v / count
        else:
            out[k] = v
    return out
