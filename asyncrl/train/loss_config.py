"""The `loss:` subtree of the training config: which RL objective and its hyperparameters.

Presets live in `configs/loss/<name>.yaml`; they fill this dataclass (OmegaConf structured config) and CLI
`loss.key=value` overrides work on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from asyncrl.config.validate import check, check_choice

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
        check_choice("loss.name", self.name, LOSS_NAMES)
        check("loss.epsilon_low", self.epsilon_low, 0.0 <= self.epsilon_low < 1.0, "in [0, 1)")
        check("loss.epsilon_high", self.epsilon_high, self.epsilon_high > 0.0, "> 0")
        check("loss.kl_coef", self.kl_coef, self.kl_coef >= 0.0, ">= 0 (0 turns the KL term off)")
        check("loss.tis_cap", self.tis_cap, self.tis_cap is None or self.tis_cap >= 1.0, "null (off) or >= 1")
        check("loss.std_eps", self.std_eps, self.std_eps > 0.0, "> 0")
        if self.normalization is not None:
            check_choice("loss.normalization", self.normalization, NORMALIZATIONS)
        check("loss.max_tokens", self.max_tokens, self.max_tokens is None or self.max_tokens >= 1, "null or >= 1")
