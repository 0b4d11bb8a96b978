"""DAPO's overlong reward shaping and overlong filtering, where the batch is built and in the step's metrics."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from asyncrl.models import Model, preset
from asyncrl.rollout import Completion, Prompt, Rollout
from asyncrl.train.advantages import prepare_loss_inputs
from asyncrl.train.batch import build_batch
from asyncrl.train.config import MeshConfig, ShardingConfig, TrainConfig
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.shaping import overlong_penalty
from asyncrl.train.trainer import Trainer
from tests.helpers import random_params

BUDGET, BUFFER = 12, 4


def dapo_length_penalty(length: int, l_max: int, l_cache: int) -> float:
    """DAPO's soft overlong punishment R_length(y) from |y|, the maximum length L_max and the buffer L_cache."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


def test_penalty_follows_the_dapo_formula():
    lengths = np.arange(0, BUDGET + 3)
    got = overlong_penalty(lengths, np.zeros(len(lengths), bool), BUDGET, BUFFER, scale=0.5)
    want = [0.5 * dapo_length_penalty(n, BUDGET, BUFFER) for n in lengths]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[BUDGET - BUFFER] == 0 and got[BUDGET - BUFFER + 1] < 0 and got[BUDGET] == -0.5
    # A completion cut at the length limit gets the whole penalty even when a long prompt cut it short.
    assert overlong_penalty(np.array([3]), np.array([True]), BUDGET, BUFFER)[0] == -1.0


# (completion length, finish reason, reward) per row of one group; the lengths straddle the buffer.
ROWS = [(4, "eos", 1.0), (9, "eos", 1.0), (11, "eos", 0.0), (12, "length", 0.0),
        (6, "eos", 0.0), (10, "eos", 1.0), (5, "length", 0.0), (8, "eos", 1.0)]


def make_group(vocab: int = 128, prompt_len: int = 3) -> list[Rollout]:
    rng = np.random.default_rng(0)
    out = []
    for g in range(2):
        comps = []
        for n, finish, reward in ROWS[4 * g:4 * g + 4]:
            forced = np.zeros(n, bool)
            forced[-1] = finish == "length"  # the engine forces the EOS at the limit
            comps.append(Completion(tokens=rng.integers(1, vocab, n).astype(np.int32),
                                    logprobs=np.where(forced, 0.0, np.log(rng.uniform(0.1, 0.9, n))).astype(np.float32),
                                    forced=forced, versions=np.zeros(n, np.int32), finish_reason=finish,
                                    reward=reward))
        out.append(Rollout(prompt=Prompt(g, SimpleNamespace(id=str(g)), 4),
                           prompt_tokens=rng.integers(1, vocab, prompt_len), completions=comps))
    return out


def test_build_batch_adds_the_penalty_to_the_reward_and_masks_truncated_samples():
    plain_cfg = LossConfig(name="dapo", epsilon_high=0.28, max_tokens=BUDGET)
    shaped_cfg = LossConfig(name="dapo", epsilon_high=0.28, max_tokens=BUDGET, overlong_buffer=BUFFER,
                            overlong_filter=True)
    plain = build_batch(make_group(), plain_cfg, pad_to_multiple=8)
    shaped = build_batch(make_group(), shaped_cfg, pad_to_multiple=8)
    lengths = np.array([n for n, _, _ in ROWS])
    truncated = np.array([f == "length" for _, f, _ in ROWS])
    want = np.array([-1.0 if t else dapo_length_penalty(n, BUDGET, BUFFER) for n, t in zip(lengths, truncated)])
    np.testing.assert_allclose(shaped.overlong_penalty, want, rtol=1e-6)
    np.testing.assert_allclose(shaped.rewards, np.array([r for _, _, r in ROWS]) + want, rtol=1e-6)
    np.testing.assert_array_equal(shaped.truncated, truncated)
    # Advantages come from the shaped rewards: a long correct answer now ranks below a short one.
    shaped_adv, shaped_w = prepare_loss_inputs(shaped.rewards, shaped.group_ids, shaped.loss_mask, shaped_cfg)
    plain_adv, _ = prepare_loss_inputs(plain.rewards, plain.group_ids, plain.loss_mask, plain_cfg)
    assert shaped_adv[1] < shaped_adv[0] and plain_adv[1] == plain_adv[0]
    # Filtering: truncated rows carry no loss; the other rows keep theirs.
    assert not shaped.loss_mask[truncated].any() and shaped_w[truncated].sum() == 0
    np.testing.assert_array_equal(shaped.loss_mask[~truncated], plain.loss_mask[~truncated])
    # Off (the default), nothing changes.
    assert not plain.overlong_penalty.any()
    np.testing.assert_array_equal(plain.rewards, [r for _, _, r in ROWS])
    with pytest.raises(ValueError, match=r"loss\.max_tokens is unset"):
        build_batch(make_group(), LossConfig(overlong_buffer=BUFFER), pad_to_multiple=8)


def test_step_reports_how_many_samples_each_one_touched():
    cfg = LossConfig(name="dapo", epsilon_high=0.28, max_tokens=BUDGET, overlong_buffer=BUFFER, overlong_filter=True)
    trainer = Trainer(Model(preset("tiny")), TrainConfig(train_batch_size=8), cfg,
                      ShardingConfig(mesh=MeshConfig(dp=1, fsdp=1)), devices=jax.devices()[:1])
    trainer.load(random_params(preset("tiny")))
    m = trainer.step(build_batch(make_group(), cfg, pad_to_multiple=8))
    truncated = sum(f == "length" for _, f, _ in ROWS)
    penalized = sum(f == "length" or n > BUDGET - BUFFER for n, f, _ in ROWS)
    assert (m["train/samples_truncated"], m["train/overlong_filtered"], m["train/overlong_penalized"]) == (
        truncated, truncated, penalized)
