"""Batch level: sequence advantages and per-token loss weights, computed on the FULL batch of a step.

Groups and normalisers must not depend on how the batch is split into micro-batches (or mini-batches): the loss
is `sum(weights * per_token_objective)`, so with weights normalised over a batch the sum of its micro-batch
losses (and gradients) equals the batch loss.

Each loss names its estimator (registered in `registry.ADVANTAGES`, computed in `estimators.py`) and its default
normalisation in its registry entry (`registry.py`):

| estimator     | advantage                        |   | normalisation | weight of a kept token                       |
|---------------|----------------------------------|---|---------------|----------------------------------------------|
| group_std     | (r - mean_g) / (std_g + std_eps) |   | seq_mean      | 1 / (len_i * B)   (mean of sequence means)   |
| group_mean    | r - mean_g                       |   | token_mean    | 1 / total_tokens                             |
| leave_one_out | r - (sum_g - r) / (G - 1)        |   | constant      | 1 / (B * max_tokens)  (length-unbiased)      |

std_g is the unbiased group std (as `torch.std` in TRL and verl). B counts kept sequences (seq_mean: those with
at least one loss token). max_tokens is the run's generation budget, a constant: never the batch's padded length,
which would rescale the gradient with each batch's longest row. `cfg.normalization` overrides the default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from asyncrl.train.estimators import same_group
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.registry import get_advantage, get_loss


def normalization(cfg: LossConfig) -> str:
    """`loss.normalization`, else the loss's default (its registry entry)."""
    return cfg.normalization or get_loss(cfg.name).normalization


def check_normalizer(cfg: LossConfig) -> None:
    """Raise early when 'constant' normalisation has no generation budget to divide by."""
    if normalization(cfg) == "constant" and cfg.max_tokens is None:
        raise ValueError(f"loss.max_tokens is unset, but loss.name={cfg.name} normalises by the constant generation "
                         "budget: set loss.max_tokens (the run config fills it from inference.max_new_tokens, "
                         "else inference.max_seq_len)")


def compute_advantages(rewards: jax.Array, group_ids: jax.Array, cfg: LossConfig) -> jax.Array:
    """Sequence advantages [B] from rewards [B] and group ids [B] (sequences sampled from the same prompt), by the
    estimator the loss's registry entry names (`registry.ADVANTAGES`)."""
    return get_advantage(get_loss(cfg.name).advantage)(rewards, group_ids, cfg)


def keep_sequences(rewards: jax.Array, group_ids: jax.Array, cfg: LossConfig) -> jax.Array:
    """[B] bool: False for filler rows (group id < 0: `batch.build_batch` with group_rows) and, when
    `cfg.filter_zero_variance`, for sequences of equal-reward groups; else True."""
    real = group_ids >= 0
    if not cfg.filter_zero_variance:
        return real
    same = same_group(group_ids)
    hi = jnp.max(jnp.where(same, rewards[None, :], -jnp.inf), axis=1)
    lo = jnp.min(jnp.where(same, rewards[None, :], jnp.inf), axis=1)
    return (hi > lo) & real


def loss_weights(mask: jax.Array, cfg: LossConfig, keep: jax.Array | None = None) -> jax.Array:
    """Token weights [B, T] normalised over the rows given; see the normalisation table in the module docstring."""
    m = mask.astype(jnp.float32)  # [B, T]
    if keep is not None:
        m = m * keep.astype(jnp.float32)[:, None]
    mode = normalization(cfg)
    if mode == "token_mean":
        return m / jnp.maximum(jnp.sum(m), 1.0)
    lengths = jnp.sum(m, axis=1)  # [B]
    if mode == "seq_mean":
        n_seqs = jnp.sum(lengths > 0)
        return m / (jnp.maximum(lengths, 1.0) * jnp.maximum(n_seqs, 1))[:, None]
    check_normalizer(cfg)
    n_seqs = m.shape[0] if keep is None else jnp.sum(keep)
    return m / (jnp.maximum(n_seqs, 1) * cfg.max_tokens)


def prepare_loss_inputs(
    rewards: jax.Array, group_ids: jax.Array, mask: jax.Array, cfg: LossConfig
) -> tuple[jax.Array, jax.Array]:
    """(advantages [B], weights [B, T]) for the full batch of one optimizer step."""
    keep = keep_sequences(rewards, group_ids, cfg)
    return compute_advantages(rewards, group_ids, cfg), loss_weights(mask, cfg, keep)
