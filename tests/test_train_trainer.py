"""Trainer state handling (load, inference copies, checkpoint hooks, validation) and the optimizer's schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.models import Model, preset
from asyncrl.models.params import Params
from asyncrl.train.batch import build_batch
from asyncrl.train.config import MeshConfig, ShardingConfig, TrainConfig
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.optimizer import decay_mask, lr_schedule
from asyncrl.train.trainer import Trainer
from tests.helpers import make_rollouts


def _trainer(**train) -> Trainer:
    return Trainer(Model(preset("tiny")), TrainConfig(train_batch_size=8, **train), LossConfig(),
                   ShardingConfig(mesh=MeshConfig(dp=2, fsdp=4), min_bytes_for_fsdp=0))


def test_load_state_dict_and_inference_copy():
    model = Model(preset("tiny"))
    host = jax.tree.map(np.asarray, model.init_params(jax.random.key(3), jnp.bfloat16))
    t = _trainer()
    with pytest.raises(RuntimeError, match="init"):
        t.params_for_inference()
    t.load(host)  # bf16 numpy in, fp32 sharded master copy out
    assert {x.dtype for x in jax.tree.leaves(t.params)} == {jnp.dtype(jnp.float32)}
    assert t.params.layers.wq.sharding == t.shardings.params.layers.wq
    np.testing.assert_array_equal(np.asarray(t.params.embed), host.embed.astype(np.float32))

    inf = t.params_for_inference(jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(inf)} == {jnp.dtype(jnp.bfloat16)}
    assert t.params.embed.dtype == jnp.float32 and not t.params.embed.is_deleted()

    t.step_count, t.version = 7, 5
    state = t.state_dict()
    other = _trainer()
    other.load_state_dict(state, params=t.params)
    assert (other.step_count, other.version) == (7, 5)
    np.testing.assert_array_equal(jax.random.key_data(other.rng), jax.random.key_data(t.rng))
    assert jax.tree.structure(other.opt_state) == jax.tree.structure(t.opt_state)

    with pytest.raises(ValueError, match="train.train_batch_size=8"):
        t.step(build_batch(make_rollouts(0, 1, 2, model.cfg.vocab_size), LossConfig()))

    abstract = t.abstract_state()
    assert isinstance(abstract["params"], Params)
    for a, x in zip(jax.tree.leaves(abstract), jax.tree.leaves({"params": t.params, "opt_state": t.opt_state})):
        assert (a.shape, a.dtype, a.sharding) == (x.shape, x.dtype, x.sharding)


def test_rejects_bad_setups():
    with pytest.raises(ValueError, match="data-parallel devices"):
        Trainer(Model(preset("tiny")), TrainConfig(train_batch_size=12, grad_accum_steps=3), LossConfig(),
                ShardingConfig(mesh=MeshConfig(dp=2, fsdp=4)))
    with pytest.raises(ValueError, match=r"loss\.max_tokens is unset"):  # dr_grpo without a generation budget
        Trainer(Model(preset("tiny")), TrainConfig(train_batch_size=8), LossConfig(name="dr_grpo"),
                ShardingConfig(mesh=MeshConfig(dp=2, fsdp=4)))
    with pytest.raises(ValueError, match="updates_per_step"):
        Trainer(Model(preset("tiny")), TrainConfig(train_batch_size=16, updates_per_step=4), LossConfig(),
                ShardingConfig(mesh=MeshConfig(dp=2, fsdp=4)))


def test_lr_schedule_warmup_then_cosine():
    cfg = TrainConfig(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    lr = [float(lr_schedule(cfg)(i)) for i in range(16)]
    np.testing.assert_allclose(lr[:4], [0.25, 0.5, 0.75, 1.0])  # the first step already moves
    assert lr[4] == pytest.approx(1.0) and lr[9] == pytest.approx(0.55) and lr[14] == pytest.approx(0.1)
    assert lr[15] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lr[4:], lr[5:]))


def test_weight_decay_skips_norm_scales():
    mask = decay_mask(preset("tiny"))
    assert mask.embed and mask.layers.wq and mask.layers.w_down
    assert not mask.final_norm and not mask.layers.attn_norm and not mask.layers.q_norm
