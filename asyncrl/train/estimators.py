"""Advantage estimators as pure array functions: `(rewards [B], group stats, cfg) -> advantages [B]`.

Each is registered by name in the advantage registry (`registry.py`: `ADVANTAGES`), which a loss's entry names;
`advantages.compute_advantages` looks it up. Groups are the sequences sampled from one prompt.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from asyncrl.train.loss_config import LossConfig


class GroupStats(NamedTuple):
    """Per sequence, its group's reward statistics; each [B]."""

    mean: jax.Array
    std: jax.Array
    """Unbiased (as `torch.std` in TRL and verl); 0 for a singleton group."""
    size: jax.Array


def same_group(group_ids: jax.Array) -> jax.Array:
    # A [B, B] comparison instead of segment sums: ids need not be dense, and B (sequences per step) is small.
    return group_ids[:, None] == group_ids[None, :]  # [B, B]


def group_stats(rewards: jax.Array, group_ids: jax.Array) -> GroupStats:
    """Per sequence, the (mean, unbiased std, size) of its group's rewards; each [B]."""
    rewards = rewards.astype(jnp.float32)
    same = same_group(group_ids).astype(jnp.float32)  # [B, B]
    # Elementwise sums, not `same @ rewards`: a TPU f32 matmul at default precision rounds through bf16.
    size = jnp.sum(same, axis=1)
    mean = jnp.sum(same * rewards[None, :], axis=1) / size
    sq = jnp.sum(same * (rewards[None, :] - mean[:, None]) ** 2, axis=1)
    std = jnp.sqrt(sq / jnp.maximum(size - 1.0, 1.0))
    return GroupStats(mean, std, size)


def group_std(rewards: jax.Array, g: GroupStats, cfg: LossConfig) -> jax.Array:
    """(r - mean_g) / (std_g + std_eps)."""
    return (rewards - g.mean) / (g.std + cfg.std_eps)


def group_mean(rewards: jax.Array, g: GroupStats, cfg: LossConfig) -> jax.Array:
    """r - mean_g."""
    return rewards - g.mean


def leave_one_out(rewards: jax.Array, g: GroupStats, cfg: LossConfig) -> jax.Array:
    """r - (sum_g - r) / (G - 1), as G / (G - 1) * (r - mean_g); a singleton group has no baseline (0)."""
    return jnp.where(g.size > 1, (rewards - g.mean) * g.size / jnp.maximum(g.size - 1.0, 1.0), 0.0)
