"""The trainer's optimizer: AdamW with global-norm clipping and a warmup + cosine learning-rate schedule.

Master params and optimizer state are fp32 (the blog keeps both in fp32; bf16 Adam moments lose small updates).
Weight decay skips norm scales: decaying a gain towards 0 shrinks the residual stream instead of regularising.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from asyncrl.models import params as params_lib
from asyncrl.models.config import ModelConfig
from asyncrl.models.params import Params
from asyncrl.train.config import TrainConfig

Schedule = Callable[[jax.Array | int], jax.Array]


def lr_schedule(cfg: TrainConfig) -> Schedule:
    """Learning rate at optimizer update `count` (0-based): linear warmup, then cosine decay to lr * min_lr_ratio.

    Counts updates, not rollout steps: with `updates_per_step` k, warmup and decay stretch over k times as many.
    Warmup starts at lr / warmup rather than 0, so that the first update of a run is not wasted (optax's
    `warmup_cosine_decay_schedule` gives exactly 0 at count 0)."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    warmup = cfg.warmup_steps * cfg.updates_per_step
    decay = max(cfg.total_steps * cfg.updates_per_step - warmup, 1)

    def schedule(count: jax.Array | int) -> jax.Array:
        count = jnp.asarray(count, jnp.float32)
        warm = peak * jnp.minimum((count + 1.0) / max(warmup, 1), 1.0)
        progress = jnp.clip((count - warmup) / decay, 0.0, 1.0)
        cosine = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(math.pi * progress))
        return jnp.where(count < warmup, warm, cosine)

    return schedule


def decay_mask(model_cfg: ModelConfig) -> Params:
    """Params tree of bools: True for matrices (embeddings, projections), False for norm scales."""
    return jax.tree.map(lambda s: s.init != "ones", params_lib.abstract(model_cfg),
                        is_leaf=lambda x: isinstance(x, params_lib.ParamSpec))


def make_optimizer(cfg: TrainConfig, model_cfg: ModelConfig, mask: Any = None,
                   labels: Any = None) -> optax.GradientTransformation:
    """clip_by_global_norm(max_grad_norm) -> AdamW(schedule, b1, b2, weight_decay on matrices only). `mask`: the
    weight-decay mask of another trained tree (LoRA's adapters, all matrices) instead of the params'. `labels`: a
    tree of "trained" / "frozen" (LoRA's A with `train.lora.freeze_a`): frozen leaves get a zero update and no
    state, and the clipping norm is the trained leaves'."""
    adamw = optax.adamw(
        learning_rate=lr_schedule(cfg),
        b1=cfg.b1,
        b2=cfg.b2,
        weight_decay=cfg.weight_decay,
        mask=decay_mask(model_cfg) if mask is None else mask,
    )
    tx = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw) if cfg.max_grad_norm > 0 else adamw
    if labels is not None:
        return optax.multi_transform({"trained": tx, "frozen": optax.set_to_zero()}, labels)
    return tx
