"""The training registries, one per concept, each entry holding everything about its item.

- Advantage estimators (`ADVANTAGES`): one entry per estimator name, with its function (`estimators.py`), the
  config fields it reads and where it comes from. Adding one is one `register_advantage` call.
- Losses (`LOSSES`): one entry per `loss.name`. Its per-token objective, its advantage estimator (a name in
  `ADVANTAGES`), its default token normalisation, the config fields it reads, where it comes from, and any check of
  its own. The config validates `loss.name` against it, the step reads it, and the tests check the presets in
  `configs/loss/` and the README's table against it. Adding a loss is one `register_loss` call.

| name        | objective (losses.py)          | advantage (estimators.py)  | normalisation |
|-------------|--------------------------------|----------------------------|---------------|
| grpo        | ppo_clip                       | group_std                  | seq_mean      |
| dapo        | ppo_clip (clip-higher)         | group_std                  | token_mean    |
| dr_grpo     | ppo_clip                       | group_mean                 | constant      |
| rloo        | ppo_clip                       | leave_one_out              | seq_mean      |
| cispo       | cispo                          | group_mean                 | token_mean    |
| gspo        | gspo (sequence ratio)          | group_std                  | seq_mean      |
| gspo_token  | gspo_token                     | group_std                  | seq_mean      |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from asyncrl.train import estimators, losses
from asyncrl.train.loss_config import LossConfig
from asyncrl.validate import ConfigError

SHARED_FIELDS = ("kl_coef", "is_mode", "is_level", "tis_cap", "is_mask_low", "is_mask_high", "normalization",
                 "max_tokens", "filter_zero_variance", "overlong_buffer", "overlong_penalty", "overlong_filter")
"""Fields every loss reads: the KL term, the rollout correction, the batch normalisation and the reward shaping."""


@dataclass(frozen=True)
class AdvantageSpec:
    """Everything about one advantage estimator. Calling it gives the sequence advantages: `(rewards [B],
    group_ids [B], cfg) -> [B]` (fp32), from the group statistics (`estimators.group_stats`)."""

    name: str
    fn: Callable[[jax.Array, estimators.GroupStats, LossConfig], jax.Array]
    """`(rewards [B] fp32, group stats, cfg) -> advantages [B]` (`estimators.group_std`, ...)."""
    reads: tuple[str, ...]
    """The LossConfig fields it reads; a loss naming it lists them in its own `reads`."""
    source: str
    """Where it is defined."""

    def __call__(self, rewards: jax.Array, group_ids: jax.Array, cfg: LossConfig) -> jax.Array:
        rewards = rewards.astype(jnp.float32)
        return self.fn(rewards, estimators.group_stats(rewards, group_ids), cfg)


ADVANTAGES: dict[str, AdvantageSpec] = {}


def register_advantage(spec: AdvantageSpec) -> AdvantageSpec:
    """Register an advantage estimator under `spec.name` (what a LossSpec's `advantage` names)."""
    if spec.name in ADVANTAGES:
        raise ValueError(f"advantage estimator {spec.name!r} is already registered")
    ADVANTAGES[spec.name] = spec
    return spec


def get_advantage(name: str) -> AdvantageSpec:
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {sorted(ADVANTAGES)}")
    return ADVANTAGES[name]


register_advantage(AdvantageSpec("group_std", estimators.group_std, ("std_eps",), "GRPO (Shao et al. 2024)"))
register_advantage(AdvantageSpec("group_mean", estimators.group_mean, (), "Dr. GRPO (Liu et al. 2025)"))
register_advantage(AdvantageSpec("leave_one_out", estimators.leave_one_out, (),
                                 "RLOO (Kool et al. 2019; Ahmadian et al. 2024)"))


@dataclass(frozen=True)
class LossSpec:
    """Everything about one loss. Calling it is the loss: `(logprobs, sampler_logprobs, advantages, weights, mask,
    cfg, ref_logprobs=None, *, prox_logprobs=None) -> (loss, metrics)` (`losses.objective`)."""

    name: str
    per_token: Callable[[LossConfig], losses.PerToken]
    """The objective per token, built from the config (`losses.ppo_clip`, `cispo`, `gspo`, `gspo_token`)."""
    advantage: str
    """Its advantage estimator: a name in `ADVANTAGES` (checked on registration)."""
    normalization: str
    """Its default token normalisation (`loss.normalization` overrides it): seq_mean, token_mean or constant."""
    reads: tuple[str, ...]
    """The LossConfig fields it reads besides `name` and `SHARED_FIELDS`; the rest are ignored by it."""
    source: str
    """Where it is defined."""
    check: Callable[[LossConfig], None] | None = None
    """Its own validation of the config, raising ConfigError naming the field."""

    def __call__(self, logprobs: jax.Array, sampler_logprobs: jax.Array, advantages: jax.Array, weights: jax.Array,
                 mask: jax.Array, cfg: LossConfig, ref_logprobs: jax.Array | None = None, *,
                 prox_logprobs: jax.Array | None = None) -> tuple[jax.Array, losses.Metrics]:
        return losses.objective(self.per_token(cfg), logprobs, sampler_logprobs, advantages, weights, mask, cfg,
                                ref_logprobs, prox_logprobs)


LOSSES: dict[str, LossSpec] = {}


def register_loss(spec: LossSpec) -> LossSpec:
    """Register a loss under `spec.name` (the value of `loss.name`); its advantage estimator must be registered,
    and the fields that estimator reads must be among the loss's."""
    if spec.name in LOSSES:
        raise ValueError(f"loss {spec.name!r} is already registered")
    estimator = get_advantage(spec.advantage)
    missing = [f for f in estimator.reads if f not in spec.reads]
    if missing:
        raise ValueError(f"loss {spec.name!r}: its advantage estimator {spec.advantage!r} reads {missing}, which "
                         "its `reads` must list")
    LOSSES[spec.name] = spec
    return spec


def get_loss(name: str) -> LossSpec:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; registered: {sorted(LOSSES)}")
    return LOSSES[name]


def validate(cfg: LossConfig) -> None:
    """`loss.name` is registered, and its entry's own check passes; raises ConfigError naming the field. The run
    config calls it (configs from YAML and the command line), and so does the train step (a LossConfig built by
    hand)."""
    if cfg.name not in LOSSES:
        raise ConfigError(f"loss.name={cfg.name!r} is invalid: must be one of {sorted(LOSSES)}")
    spec = LOSSES[cfg.name]
    if spec.check is not None:
        spec.check(cfg)


def _cispo_cap(cfg: LossConfig) -> None:
    if cfg.epsilon_high < 1.0:
        raise ConfigError(
            f"loss.epsilon_high={cfg.epsilon_high!r} is invalid for loss.name=cispo: must be >= 1. CISPO caps "
            f"the importance weight itself at epsilon_high, so {cfg.epsilon_high} would scale every on-policy "
            f"token (weight 1) down to {cfg.epsilon_high}: a hidden {1 / cfg.epsilon_high:.3g}x learning-rate "
            "cut. MiniMax-M1's 1 + eps_high is written e.g. 1.28 here (configs/loss/cispo.yaml uses 1.0)")


_CLIP = ("epsilon_low", "epsilon_high")
register_loss(LossSpec("grpo", losses.ppo_clip, "group_std", "seq_mean", (*_CLIP, "std_eps"),
                       "DeepSeekMath (Shao et al. 2024)"))
register_loss(LossSpec("dapo", losses.ppo_clip, "group_std", "token_mean", (*_CLIP, "std_eps"),
                       "DAPO (Yu et al. 2025)"))
register_loss(LossSpec("dr_grpo", losses.ppo_clip, "group_mean", "constant", _CLIP,
                       "Understanding R1-Zero-Like Training: A Critical Perspective (Liu et al. 2025)"))
register_loss(LossSpec("rloo", losses.ppo_clip, "leave_one_out", "seq_mean", _CLIP,
                       "RLOO: Buy 4 REINFORCE Samples, Get a Baseline for Free! (Kool et al. 2019); "
                       "Ahmadian et al. 2024"))
register_loss(LossSpec("cispo", losses.cispo, "group_mean", "token_mean", ("epsilon_high",),
                       "MiniMax-M1 (MiniMax 2025)", check=_cispo_cap))
register_loss(LossSpec("gspo", losses.gspo, "group_std", "seq_mean", (*_CLIP, "std_eps"),
                       "GSPO, Group Sequence Policy Optimization (Zheng et al. 2025); AReaL's sequence-level form"))
register_loss(LossSpec("gspo_token", losses.gspo_token, "group_std", "seq_mean", (*_CLIP, "std_eps"),
                       "GSPO-token (Zheng et al. 2025); verl's form"))
