"""DAPO's overlong handling: a soft length penalty added to the reward, and masking of truncated samples.

With L_max the generation budget (`loss.max_tokens`: the most tokens a completion can hold) and L_cache the
buffer (`loss.overlong_buffer`), DAPO's length-aware penalty of a completion of |y| tokens is

    0                                  if |y| <= L_max - L_cache
    ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
    -1                                 if |y| > L_max,

scaled by `loss.overlong_penalty` and added to the verifier's reward. A completion the engine cut at the length
limit (finish_reason 'length') would have run past L_max, so it gets the full -1 whatever its length (with only
`inference.max_seq_len` limiting, a long prompt cuts its completion short of L_max). Overlong filtering
(`loss.overlong_filter`) instead takes truncated completions out of the loss: their reward says nothing about
an answer that was never finished. Both run on the host, where the batch is built.
"""

from __future__ import annotations

import numpy as np

from asyncrl.train.loss_config import LossConfig


def overlong_penalty(lengths: np.ndarray, truncated: np.ndarray, max_tokens: int, buffer: int,
                     scale: float = 1.0) -> np.ndarray:
    """[B] float32 reward shaping (<= 0) from completion lengths [B] and the truncated flags [B]."""
    lengths = np.asarray(lengths, np.float64)
    start = max_tokens - buffer
    ramp = np.clip((start - lengths) / buffer, -1.0, 0.0)
    return (scale * np.where(np.asarray(truncated, bool), -1.0, ramp)).astype(np.float32)


def shaping_for(lengths: np.ndarray, truncated: np.ndarray, cfg: LossConfig) -> np.ndarray:
    """The penalty `cfg` asks for ([B] zeros when `loss.overlong_buffer` is off)."""
    if cfg.overlong_buffer is None:
        return np.zeros(len(lengths), np.float32)
    if cfg.max_tokens is None:
        raise ValueError("loss.overlong_buffer is set but loss.max_tokens is unset: the penalty runs over the last "
                         "overlong_buffer tokens of the generation budget (the run config fills max_tokens from "
                         "the inference section)")
    return overlong_penalty(lengths, truncated, cfg.max_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
