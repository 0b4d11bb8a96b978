"""The `loss:` subtree of the training config: which RL objective, its rollout correction and reward shaping.

Presets live in `configs/loss/<name>.yaml`; they fill this dataclass (OmegaConf structured config) and CLI
`loss.key=value` overrides work on top. Which fields each loss reads, and `loss.name` itself, are checked against
the loss registry (`registry.py`: `validate`), which the run config calls; every preset repeats its entry's
fields in a `# Reads:` line (tests/test_losses.py keeps the two in step).
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.validate import ConfigError, check, check_choice

NORMALIZATIONS = ("seq_mean", "token_mean", "constant")
IS_MODES = ("truncate", "mask")
IS_LEVELS = ("token", "sequence", "geometric")


@dataclass(frozen=True)
class LossConfig:
    """Hyperparameters of the policy-gradient loss; see `asyncrl/train/losses.py` for the formulas."""

    name: str = "grpo"
    """Objective: a name in the loss registry (`asyncrl/train/registry.py`): 'cispo', 'grpo', 'dr_grpo', 'dapo',
    'rloo', 'gspo' or 'gspo_token'. Its entry also picks the advantage estimator and the default token
    normalisation."""
    epsilon_low: float = 0.2
    """PPO clip: the ratio is clipped below at 1 - epsilon_low (for gspo: the sequence ratio). Unused by cispo."""
    epsilon_high: float = 0.2
    """PPO clip: the ratio is clipped above at 1 + epsilon_high. For cispo it is the absolute cap on the
    importance weight, min(ratio, epsilon_high), as in the seed blog's formula (not 1 + epsilon_high), and must
    be >= 1."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the reference policy, the params the run started from (after any format
    warm-start). 0 turns it off, and no reference is kept."""
    is_mode: str | None = None
    """Rollout correction between the proximal policy and the sampler ('behaviour'): 'truncate' (TIS, weight
    min(w, tis_cap)), 'mask' (MIS, weight w where is_mask_low <= w <= is_mask_high, else 0), or None: off, unless
    tis_cap is set, which alone means 'truncate'. w = pi_prox / pi_sampler at the level of `is_level`."""
    is_level: str = "token"
    """Where the correction weight w is taken: 'token' (per token), 'sequence' (product over the sequence's loss
    tokens) or 'geometric' (geometric mean over them). Sequence levels weight every token of a row alike."""
    tis_cap: float | None = None
    """The cap C of is_mode='truncate' (>= 1). Setting it without is_mode turns truncation on."""
    is_mask_low: float = 0.5
    """Lower bound of the kept band of is_mode='mask' (in [0, 1])."""
    is_mask_high: float = 2.0
    """Upper bound of the kept band of is_mode='mask' (>= 1)."""
    std_eps: float = 1e-6
    """Added to the group reward std before dividing (grpo, dapo, gspo), so that equal-reward groups give 0, not
    NaN."""
    filter_zero_variance: bool = False
    """Drop groups whose rewards are all equal from the batch normalisation (their weights become 0), as DAPO's
    dynamic sampling does; they carry no policy gradient anyway."""
    normalization: str | None = None
    """Override the token normalisation: 'seq_mean', 'token_mean' or 'constant'. None uses the loss's default."""
    max_tokens: int | None = None
    """The generation budget in completion tokens: the constant of 'constant' normalisation (Dr. GRPO) and the
    end of the overlong buffer. None: the run config fills it from the inference section (`generation_budget`);
    a LossConfig built by hand must set it for either use."""
    overlong_buffer: int | None = None
    """DAPO's soft overlong punishment: a completion of L tokens with L > max_tokens - overlong_buffer gets
    overlong_penalty * (max_tokens - overlong_buffer - L) / overlong_buffer added to its reward, and one cut by
    the length limit gets -overlong_penalty. None turns it off."""
    overlong_penalty: float = 1.0
    """The largest overlong punishment (DAPO: 1, the reward scale)."""
    overlong_filter: bool = False
    """DAPO's overlong filtering: completions cut by the length limit carry no loss (their tokens are masked)."""

    def __post_init__(self) -> None:
        check("loss.epsilon_low", self.epsilon_low, 0.0 <= self.epsilon_low < 1.0, "in [0, 1)")
        check("loss.epsilon_high", self.epsilon_high, self.epsilon_high > 0.0, "> 0")
        check("loss.kl_coef", self.kl_coef, self.kl_coef >= 0.0, ">= 0 (0 turns the KL term off)")
        if self.is_mode is not None:
            check_choice("loss.is_mode", self.is_mode, IS_MODES)
        check_choice("loss.is_level", self.is_level, IS_LEVELS)
        check("loss.tis_cap", self.tis_cap, self.tis_cap is None or self.tis_cap >= 1.0, "null (off) or >= 1")
        if self.is_mode == "truncate":
            check("loss.tis_cap", self.tis_cap, self.tis_cap is not None, "set (>= 1) when loss.is_mode=truncate")
        if self.is_mode == "mask" and self.tis_cap is not None:
            raise ConfigError(f"loss.tis_cap={self.tis_cap!r} is invalid with loss.is_mode=mask: must be null "
                              "(masking keeps the band [is_mask_low, is_mask_high] instead of truncating)")
        check("loss.is_mask_low", self.is_mask_low, 0.0 <= self.is_mask_low <= 1.0, "in [0, 1]")
        check("loss.is_mask_high", self.is_mask_high, self.is_mask_high >= 1.0, ">= 1")
        check("loss.std_eps", self.std_eps, self.std_eps > 0.0, "> 0")
        if self.normalization is not None:
            check_choice("loss.normalization", self.normalization, NORMALIZATIONS)
        check("loss.max_tokens", self.max_tokens, self.max_tokens is None or self.max_tokens >= 1, "null or >= 1")
        if self.overlong_buffer is not None:
            check("loss.overlong_buffer", self.overlong_buffer, self.overlong_buffer >= 1, "null (off) or >= 1")
            if self.max_tokens is not None:
                check("loss.overlong_buffer", self.overlong_buffer, self.overlong_buffer < self.max_tokens,
                      f"< loss.max_tokens={self.max_tokens} (the buffer is the end of the generation budget)")
        check("loss.overlong_penalty", self.overlong_penalty, self.overlong_penalty >= 0.0, ">= 0")

    @property
    def correction(self) -> str:
        """'off', 'truncate' or 'mask': the rollout correction in force."""
        if self.is_mode is not None:
            return self.is_mode
        return "truncate" if self.tis_cap is not None else "off"
