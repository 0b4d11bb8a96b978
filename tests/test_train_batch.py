"""Rollouts -> RLBatch layout on hand-built records, padding, and combining host metrics."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.rollout import Completion, Prompt, Rollout
from asyncrl.train.advantages import prepare_loss_inputs
from asyncrl.train.batch import build_batch, combine_host_metrics, pad_batch
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.step import with_loss_inputs
from tests.helpers import make_rollouts


def _completion(tokens, logprobs, forced, versions, reward) -> Completion:
    return Completion(tokens=np.asarray(tokens, np.int32), logprobs=np.asarray(logprobs, np.float32),
                      forced=np.asarray(forced, bool), versions=np.asarray(versions, np.int32), reward=reward)


def test_build_batch_layout():
    g0 = Rollout(prompt=Prompt(0, SimpleNamespace(id="a", answer=""), 2), prompt_tokens=np.array([5, 6, 7], np.int32),
                 completions=[_completion([10, 11, 12], [-1.0, -2.0, 0.0], [0, 0, 1], [3, 3, 4], 1.0),
                              _completion([13], [-0.5], [0], [4], 0.0)])
    g1 = Rollout(prompt=Prompt(1, SimpleNamespace(id="b", answer=""), 2), prompt_tokens=np.array([8], np.int32),
                 completions=[_completion([20, 21, 22, 23, 24, 25, 26, 27, 28], [-0.1] * 9, [0] * 9, [5] * 9, 1.0),
                              _completion([30, 31], [-0.2, -0.3], [0, 0], [5, 5], 1.0)])
    cfg = LossConfig(name="dapo")
    b = build_batch([g0, g1], loss_cfg=cfg, pad_to_multiple=8)
    assert b.tokens.shape == (4, 16) and b.tokens.dtype == np.int32  # longest row 10 -> next multiple of 8
    np.testing.assert_array_equal(b.tokens[0, :7], [5, 6, 7, 10, 11, 12, 0])
    np.testing.assert_array_equal(b.tokens[2, :11], [8, 20, 21, 22, 23, 24, 25, 26, 27, 28, 0])
    np.testing.assert_array_equal(b.seq_lens, [6, 4, 10, 3])
    # Index t is the sampler's logprob of token t; prompt, forced and pad positions are 0 and out of the loss.
    np.testing.assert_allclose(b.sampler_logprobs[0, :7], [0, 0, 0, -1.0, -2.0, 0, 0])
    np.testing.assert_array_equal(b.loss_mask[0, :7], [0, 0, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(b.loss_mask.sum(1), [2, 1, 9, 2])
    np.testing.assert_array_equal(b.group_ids, [0, 0, 1, 1])
    np.testing.assert_allclose(b.rewards, [1, 0, 1, 1])
    # Advantages and weights are the step's (computed once, over the global batch), not the host batch's.
    assert not hasattr(b, "advantages") and not hasattr(b, "weights")
    lb = with_loss_inputs(jax.tree.map(jnp.asarray, b), cfg)
    adv, w = prepare_loss_inputs(b.rewards, b.group_ids, b.loss_mask, cfg)
    np.testing.assert_allclose(lb.advantages, np.asarray(adv))
    np.testing.assert_allclose(lb.advantages[2:], [0, 0])  # group 1 has no variance
    np.testing.assert_allclose(lb.weights, np.asarray(w))
    np.testing.assert_allclose(lb.weights.sum(), 1.0, rtol=1e-6)  # token_mean over the whole batch
    np.testing.assert_array_equal(lb.tokens, b.tokens)


def test_build_batch_rejects_bad_input():
    r = make_rollouts(0, 1, 2, 50)[0]
    with pytest.raises(ValueError, match="does not fit seq_len"):
        build_batch([r], LossConfig(), seq_len=3)
    r.prompt_tokens = np.zeros((0,), np.int32)
    with pytest.raises(ValueError, match=r"rollout of s0 \(data position 0\) has an empty prompt"):
        build_batch([r], LossConfig())
    r = make_rollouts(0, 1, 2, 50)[0]
    r.completions[1].reward = None
    with pytest.raises(ValueError, match=r"rollout of s0 \(data position 0\) has unscored completions"):
        build_batch([r], LossConfig())


def test_pad_batch_keeps_values():
    b = build_batch(make_rollouts(0, 2, 2, 50), LossConfig(), pad_to_multiple=16)
    p = pad_batch(b, 32)
    assert p.tokens.shape == (4, 32) and p.loss_mask.shape == (4, 32) and p.sampler_logprobs.shape == (4, 32)
    np.testing.assert_array_equal(p.tokens[:, :16], b.tokens)
    assert not p.loss_mask[:, 16:].any() and not p.tokens[:, 16:].any()
    with pytest.raises(ValueError):
        pad_batch(b, 8)


def test_combine_host_metrics_by_suffix():
    out = combine_host_metrics([
        {"rollout/lag_min": 1.0, "rollout/lag_max": 3.0, "rollout/lag_mean": 2.0, "rollout/filtered_lag": 2.0},
        {"rollout/lag_min": 0.0, "rollout/lag_max": 5.0, "rollout/lag_mean": 1.0, "rollout/filtered_lag": 1.0},
    ])
    assert out == {"rollout/lag_min": 0.0, "rollout/lag_max": 5.0, "rollout/lag_mean": 1.5, "rollout/filtered_lag": 3.0}
