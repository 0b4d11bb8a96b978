"""The `loss:` subtree of the training config: which RL objective and its hyperparameters.

Presets live in `configs/loss/<name>.yaml`; they fill this dataclass (OmegaConf structured config) and CLI
`loss.key=value` overrides work on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

LOSS_NAMES = ("cispo", "grpo", "dr_grpo", "dapo", "rloo")
NORMALIZATIONS = ("seq_mean", "token_mean", "constant")


@dataclass(frozen=True)
class LossConfig:
    """Hyperparameters of the policy-gradient loss; see `asyncrl/train/losses.py` for the formulas."""

    name: str = "grpo"
    """Objective: 'cispo', 'grpo', 'dr_grpo', 'dapo' or 'rloo'. Also picks the advantage estimator and the
    default token normalisation (table in losses.py)."""
    epsilon_low: float = 0.2
    """PPO clip: the ratio is clipped below at 1 - epsilon_low. Unused by cispo."""
    epsilon_high: float = 0.2
    """PPO clip: the ratio is clipped above at 1 + epsilon_high. For cispo it is the absolute cap on the
    importance weight, min(ratio, epsilon_high), as in the seed blog's formula (not 1 + epsilon_high)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the reference policy; 0 turns it off (and no reference logprobs are needed)."""
    tis_cap: Optional[float] = None
    """Truncated importance sampling: cap on the sampler->trainer weight exp(lp_trainer - lp_sampler) that corrects
    for the inference engine's numerics; the PPO ratio is then taken against the trainer's own (proximal)
    logprobs. None turns it off and the ratio is taken against the sampler's logprobs."""
    std_eps: float = 1e-6
    """Added to the group reward std before dividing (grpo, dapo), so that equal-reward groups give 0, not NaN."""
    filter_zero_variance: bool = False
    """Drop groups whose rewards are all equal from the batch normalisation (their weights become 0), as DAPO's
    dynamic sampling does; they carry no policy gradient anyway."""
    normalization: Optional[str] = None
    """Override the token normalisation: 'seq_mean', 'token_mean' or 'constant'. None uses the loss's default."""
    max_tokens: Optional[int] = None
    """The constant of 'constant' normalisation (Dr. GRPO's generation budget). None uses the padded length T of
    the batch, which must then be the same for every micro-batch of a step."""

    def __post_init__(self) -> None:
        def bad(field: str, allowed: str) -> ValueError:
            return ValueError(f"loss.{field}={getattr(self, field)!r} is invalid: allowed {allowed}")

        if self.name not in LOSS_NAMES:
            raise bad("name", f"one of {LOSS_NAMES}")
        if not 0.0 <= self.epsilon_low < 1.0:
            raise bad("epsilon_low", "0 <= epsilon_low < 1")
        if not self.epsilon_high > 0.0:
            raise bad("epsilon_high", "epsilon_high > 0")
        if not self.kl_coef >= 0.0:
            raise bad("kl_coef", "kl_coef >= 0")
        if self.tis_cap is not None and not self.tis_cap >= 1.0:
            raise bad("tis_cap", "None or tis_cap >= 1")
        if not self.std_eps > 0.0:
            raise bad("std_eps", "std_eps > 0")
        if self.normalization is not None and self.normalization not in NORMALIZATIONS:
            raise bad("normalization", f"None or one of {NORMALIZATIONS}")
        if self.max_tokens is not None and not self.max_tokens >= 1:
            raise bad("max_tokens", "None or max_tokens >= 1")
