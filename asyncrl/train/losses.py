"""RL policy-gradient losses as pure array functions: the per-token objectives and the plumbing they share. Each
`loss.name` is one entry of the registry (`registry.py`), which pairs an objective here with its advantage
estimator, default normalisation and config fields; `registry.get_loss(name)` is the loss, with the signature of
`LossFn`. Inputs per micro-batch:
`logprobs` [B, T] (trainer, differentiated), `sampler_logprobs` [B, T] (what the inference engine recorded: the
behaviour policy), `advantages` [B], `weights` [B, T], `mask` [B, T], and optionally `prox_logprobs` [B, T] (the
proximal policy: the trainer's params before the step's first update) and `ref_logprobs` [B, T] (the reference
policy of the KL term). Logprobs follow the temperature convention of `asyncrl/ops/logprobs.py`. Advantages and
weights come from `asyncrl/train/advantages.py` (computed on the whole batch, table there).

The loss is `sum(weights * c * per_token_objective) + kl_coef * sum(weights * k3)`, minimised, with A the row's
advantage and lp_old the policy the ratio is taken against:
- grpo, dapo, dr_grpo, rloo: PPO clip, -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A), r = exp(lp - lp_old).
- cispo: -sg(min(r, eps_high)) * A * lp (seed blog / MiniMax-M1; every token keeps its gradient).
- gspo (GSPO, Zheng et al. 2025): the PPO clip on the row's length-normalised sequence ratio
  s = exp(mean_t (lp - lp_old)), the same for every token of the row; with seq_mean weights the loss is
  -1/B sum_i min(s_i A_i, clip(s_i) A_i), the paper's objective.
- gspo_token: GSPO-token's ratio sg(s) * exp(lp - sg(lp)): the value of s, each token's own gradient.
  The two agree in value always, and in gradient when every token of a row carries the same factor c (one
  advantage per row, as here, and no token-level correction), as the paper notes. With a token-level correction
  (`loss.tis_cap` or `loss.is_mode=mask` at `is_level=token`) they differ in gradient: gspo spreads the row's
  corrected objective evenly over its tokens (the gradient flows through s, a mean over the row), which is AReaL's
  sequence-level form; gspo_token gives each token its own factor c_t (verl's form). Their gradients still sum
  to the same over a row. On the 2 x 3 batch of tests/test_losses.py with tis_cap=1.5 the row-0 gradients are
  [-0.178, -0.178, -0.178] (gspo) against [-0.184, -0.249, -0.101] (gspo_token).

lp_old and the correction factor c (decoupled PPO, AReaL; `asyncrl/train/correction.py`):
- With `prox_logprobs` (the step passes them when `train.updates_per_step > 1`), r = pi / pi_prox.
- Without them, and with a rollout correction on (`loss.is_mode` / `loss.tis_cap`), the proximal policy is the
  trainer's current one: lp_old = sg(lp), r == 1 in value (one update per batch: the params have not moved).
- Without either, lp_old is the sampler's logprob and c = 1: plain PPO against the behaviour policy.
- With a correction on, c = sg(correction weight of pi_prox / pi_sampler) (truncated or masked, token or sequence
  level); otherwise c = 1.
With `cfg.kl_coef > 0`, k3 = exp(ref - lp) - (ref - lp) - 1 (Schulman's k3 estimator of KL(pi || pi_ref)).

Metrics are reducible across micro-batches and devices by key suffix: `*_min` by min, `*_max` by max, everything
else by sum. `reduce_metrics` applies that rule; `finalize_metrics` turns `<x>_sum` into the per-token mean `<x>`
and `<x>_tokens` into the fraction `<x>_frac`, both over `token_count`. Min/max over a batch without tokens are
+inf/-inf.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp

from asyncrl.train.correction import correction_weights
from asyncrl.train.loss_config import LossConfig

Metrics = dict[str, jax.Array]
# (log ratio [B, T], 0 off the mask; advantage [B, 1]; lp [B, T]; mask [B, T] float)
#   -> (objective [B, T], clipped [B, T] bool, ratio [B, T] as reported in the metrics)
PerToken = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]


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


# ---------------------------------------------------------------------------------------------------------------
# Per micro-batch: the losses.


def _masked_diff(a: jax.Array, b: jax.Array, m: jax.Array) -> jax.Array:
    # Padding positions may hold -inf or garbage; exp() of those would turn 0 * inf into NaN in the loss.
    return jnp.where(m, a - b, 0.0)


def objective(
    per_token: PerToken,
    logprobs: jax.Array,
    sampler_logprobs: jax.Array,
    advantages: jax.Array,
    weights: jax.Array,
    mask: jax.Array,
    cfg: LossConfig,
    ref_logprobs: jax.Array | None,
    prox_logprobs: jax.Array | None,
) -> tuple[jax.Array, Metrics]:
    """One loss: the shared ratio / correction / KL / metrics plumbing around its `per_token` objective (the
    registry's entries call it, `registry.LossSpec.__call__`)."""
    sg = jax.lax.stop_gradient
    m = mask.astype(bool)  # [B, T]
    mf = m.astype(jnp.float32)
    lp = logprobs.astype(jnp.float32)
    lp_sampler = sampler_logprobs.astype(jnp.float32)
    w = weights.astype(jnp.float32) * mf
    adv = advantages.astype(jnp.float32)[:, None]  # [B, 1]

    corrected = cfg.correction != "off"
    if prox_logprobs is not None:
        lp_old = prox_logprobs.astype(jnp.float32)
    elif corrected:
        lp_old = sg(lp)
    else:
        lp_old = lp_sampler
    objective, clipped, ratio = per_token(_masked_diff(lp, lp_old, m), adv, lp, mf)
    metrics: Metrics = {}
    if corrected:
        factor, correction_metrics = correction_weights(lp_old, lp_sampler, m, cfg)
        objective = objective * factor
        metrics |= correction_metrics
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


def _clip(ratio: jax.Array, adv: jax.Array, cfg: LossConfig) -> tuple[jax.Array, jax.Array]:
    """PPO's pessimistic clipped surrogate (negated) and where the clip removed the gradient."""
    lo, hi = 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high
    objective = -jnp.minimum(ratio * adv, jnp.clip(ratio, lo, hi) * adv)
    clipped = ((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo))  # tokens with no gradient
    return objective, clipped


def ppo_clip(cfg: LossConfig) -> PerToken:
    def per_token(log_ratio: jax.Array, adv: jax.Array, lp: jax.Array, mf: jax.Array):
        ratio = jnp.exp(log_ratio)
        return *_clip(ratio, adv, cfg), ratio

    return per_token


def _sequence_log_ratio(log_ratio: jax.Array, mf: jax.Array) -> jax.Array:
    """GSPO's length-normalised log sequence ratio, mean_t log_ratio over the row's loss tokens: [B, 1]."""
    return jnp.sum(log_ratio, axis=1, keepdims=True) / jnp.maximum(jnp.sum(mf, axis=1, keepdims=True), 1.0)


def gspo(cfg: LossConfig) -> PerToken:
    def per_token(log_ratio: jax.Array, adv: jax.Array, lp: jax.Array, mf: jax.Array):
        s = jnp.exp(_sequence_log_ratio(log_ratio, mf))  # [B, 1]
        objective, clipped = _clip(s, adv, cfg)
        shape = log_ratio.shape
        return jnp.broadcast_to(objective, shape), jnp.broadcast_to(clipped, shape), jnp.broadcast_to(s, shape)

    return per_token


def gspo_token(cfg: LossConfig) -> PerToken:
    def per_token(log_ratio: jax.Array, adv: jax.Array, lp: jax.Array, mf: jax.Array):
        sg = jax.lax.stop_gradient
        s = sg(jnp.exp(_sequence_log_ratio(log_ratio, mf)))  # [B, 1]
        ratio = s * jnp.exp(jnp.where(mf > 0, lp - sg(lp), 0.0))  # value s, gradient of the token's own lp
        return *_clip(ratio, adv, cfg), ratio

    return per_token


def cispo(cfg: LossConfig) -> PerToken:
    def per_token(log_ratio: jax.Array, adv: jax.Array, lp: jax.Array, mf: jax.Array):
        ratio = jnp.exp(log_ratio)
        capped = jax.lax.stop_gradient(jnp.minimum(ratio, cfg.epsilon_high))
        return -capped * adv * lp, ratio > cfg.epsilon_high, ratio

    return per_token


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
    """Reduced sums -> loggable values: `<x>_sum` -> mean `<x>`, `<x>_tokens` -> `<x>_frac` over token_count, and
    the correction's `is_ess` from its first two moments."""
    count = jnp.maximum(metrics["token_count"], 1.0)
    out: Metrics = {}
    for k, v in metrics.items():
        if k.endswith("_sum"):
            out[k.removesuffix("_sum")] = v / count
        elif k.endswith("_tokens"):
            out[k.removesuffix("_tokens") + "_frac"] = v / count
        else:
            out[k] = v
    if "is_applied_sq" in out:
        # Kish ESS fraction from two means over the same tokens: (sum a)^2 / (n sum a^2) == mean^2 / mean(a^2).
        sq = out.pop("is_applied_sq")
        out["is_ess"] = jnp.where(sq > 0, out["is_applied"] ** 2 / jnp.where(sq > 0, sq, 1.0), 0.0)
    return out
