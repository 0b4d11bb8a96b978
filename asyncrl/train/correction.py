"""Rollout correction: the importance weight between the proximal policy and the sampler (the behaviour policy).

Decoupled PPO (AReaL) separates two policies that plain PPO conflates. The PPO ratio pi / pi_prox is clipped
against the proximal policy, the trainer's own params before the step's first update; this is the trust region.
The sampler's logprobs differ from pi_prox by the staleness of asynchronous rollouts and by the inference engine's
numerics. That gap is corrected by a separate, detached weight w = pi_prox / pi_sampler, configured here:

- `is_level`: 'token': w_t per token. 'sequence': the product of w_t over the row's loss tokens (the unbiased
  sequence weight, with high variance). 'geometric': its geometric mean, exp(mean_t log w_t), as GSPO takes its
  ratio. Sequence levels give every token of a row the same weight.
- `is_mode`: 'truncate' (TIS, Yao et al.): min(w, C). Biased, with bounded variance. 'mask' (MIS / IcePop):
  w where C_low <= w <= C_high, else 0; a token or row outside the band drops out of the loss (the normaliser
  still counts it, so masking never up-weights the rest).

Metrics (reducible by the suffix rule of losses.py; per token, a sequence weight counted once per token):
`is_weight` mean of the raw w, `is_weight_min/max`, `is_truncated_frac` or `is_masked_frac`, `is_applied` the mean
weight actually applied and `is_ess`, the Kish effective sample size of the applied weights as a fraction of the
tokens, (sum a)^2 / (n sum a^2): 1 when every weight is equal, small when a few tokens carry the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from asyncrl.train.loss_config import LossConfig

# exp() of a sequence's summed log-weights overflows float32 past ~88; the weight is only compared with caps
# and reported, so it is taken at most e^60 (~1e26), far above any cap.
_MAX_LOG_WEIGHT = 60.0


def correction_log_weights(lp_prox: jax.Array, lp_sampler: jax.Array, mask: jax.Array, level: str) -> jax.Array:
    """log w [B, T] at `level`, 0 off the mask. Inputs are fp32 [B, T]; mask bool [B, T]."""
    log_w = jnp.where(mask, lp_prox - lp_sampler, 0.0)  # [B, T]
    if level == "token":
        return log_w
    total = jnp.sum(log_w, axis=1, keepdims=True)  # [B, 1]
    if level == "geometric":
        total = total / jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1).astype(jnp.float32)
    return jnp.where(mask, total, 0.0)


def correction_weights(lp_prox: jax.Array, lp_sampler: jax.Array, mask: jax.Array,
                       cfg: LossConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(applied weight [B, T], metrics): the detached factor each token's objective is multiplied by."""
    sg = jax.lax.stop_gradient
    m = mask.astype(bool)
    mf = m.astype(jnp.float32)
    w = jnp.exp(jnp.minimum(correction_log_weights(sg(lp_prox), sg(lp_sampler), m, cfg.is_level), _MAX_LOG_WEIGHT))
    mode = cfg.correction
    if mode == "truncate":
        applied = jnp.minimum(w, cfg.tis_cap)
        touched = (w > cfg.tis_cap) & m
        key = "is_truncated_tokens"
    elif mode == "mask":
        keep = (w >= cfg.is_mask_low) & (w <= cfg.is_mask_high)
        applied = jnp.where(keep, w, 0.0)
        touched = ~keep & m
        key = "is_masked_tokens"
    else:
        raise ValueError(f"correction_weights called with the correction off (loss.is_mode={cfg.is_mode!r})")
    applied = applied * mf
    metrics = {
        "is_weight_sum": jnp.sum(w * mf),
        "is_weight_min": jnp.min(jnp.where(m, w, jnp.inf)),
        "is_weight_max": jnp.max(jnp.where(m, w, -jnp.inf)),
        key: jnp.sum(touched),
        "is_applied_sum": jnp.sum(applied),
        "is_applied_sq_sum": jnp.sum(applied * applied),
    }
    return sg(applied), metrics
