"""Gradient accumulation: 4 micro-batches give the same update as one batch, for every loss (fp32, tiny model).

Weights are normalised over the full batch before it is split, so the micro-batch sum is the full-batch loss.
Every loss compiles two train steps (~5-15 s each on 2 busy cores), so only cispo runs in the
default suite; the others are marked slow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.models import Model, preset
from asyncrl.train.batch import build_batch
from asyncrl.train.config import MeshConfig, ShardingConfig, TrainConfig
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.mesh import shard_batch
from asyncrl.train.registry import LOSSES
from asyncrl.train.step import make_train_step
from asyncrl.train.trainer import Trainer
from tests.helpers import make_rollouts, random_params

DEFAULT_SUITE = ("cispo",)  # the default loss; the PPO-clip family runs with the slow tests
TRAIN = TrainConfig(train_batch_size=32, lr=1e-4, weight_decay=0.1)


@pytest.fixture(scope="module")
def trainer() -> Trainer:
    t = Trainer(Model(preset("tiny")), TRAIN, LossConfig(), ShardingConfig(mesh=MeshConfig(dp=1, fsdp=1)),
                devices=jax.devices()[:1])
    t.load(random_params(preset("tiny")))
    return t


def _step(trainer: Trainer, loss_cfg: LossConfig, grad_accum_steps: int, batch):
    fn = make_train_step(trainer.model, trainer.tx, loss_cfg, trainer.schedule, trainer.shardings, grad_accum_steps,
                         trainer.temperature, chunk_size=64)
    params = jax.tree.map(jnp.copy, trainer.params)  # the step donates its inputs
    opt_state = jax.tree.map(jnp.copy, trainer.opt_state)
    with jax.set_mesh(trainer.mesh):
        return fn(params, opt_state, shard_batch(batch, trainer.shardings), jnp.int32(0))


@pytest.mark.parametrize("name", [n if n in DEFAULT_SUITE else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(LOSSES)])
def test_four_micro_batches_equal_one_batch(trainer, name):
    loss_cfg = LossConfig(name=name, epsilon_high=1.0 if name == "cispo" else 0.2, max_tokens=64)
    batch = build_batch(make_rollouts(3, 8, 4, preset("tiny").vocab_size), loss_cfg, pad_to_multiple=16)
    p1, o1, m1 = _step(trainer, loss_cfg, 1, batch)
    p4, o4, m4 = _step(trainer, loss_cfg, 4, batch)
    for k in m1:
        # np.asarray: the metrics also hold the [G, 4] group_weights sums (train/ess.py)
        np.testing.assert_allclose(np.asarray(m4[k]), np.asarray(m1[k]), rtol=1e-5, atol=1e-6, err_msg=k)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path((p1, o1)), jax.tree.leaves((p4, o4))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0, err_msg=jax.tree_util.keystr(path))
    assert float(m1["grad_norm"]) > 0


def test_remat_gives_the_same_update_with_less_activation_memory(trainer):
    """Activation checkpointing recomputes the layer activations: same update, smaller compiled temp memory."""
    loss_cfg = LossConfig()
    batch = build_batch(make_rollouts(3, 8, 4, preset("tiny").vocab_size), loss_cfg, pad_to_multiple=16)
    p1, o1, m1 = _step(trainer, loss_cfg, 1, batch)
    remat = trainer.model.with_remat(True)
    fn = make_train_step(remat, trainer.tx, loss_cfg, trainer.schedule, trainer.shardings, 1, trainer.temperature,
                         chunk_size=64)
    args = (jax.tree.map(jnp.copy, trainer.params), jax.tree.map(jnp.copy, trainer.opt_state),
            shard_batch(batch, trainer.shardings), jnp.int32(0))
    with jax.set_mesh(trainer.mesh):
        p2, o2, m2 = fn(*args)
    np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-6, atol=1e-7)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path((p1, o1)), jax.tree.leaves((p2, o2))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0, err_msg=jax.tree_util.keystr(path))

    # The compiled step of a longer batch needs less scratch memory with remat (tiny model, 2 layers: the
    # saving is the per-layer MLP/attention intermediates of one of the two layers).
    long = build_batch(make_rollouts(8, 8, 4, preset("tiny").vocab_size, prompt_len=16, max_new=96), loss_cfg,
                       pad_to_multiple=16)

    def temp_bytes(model):
        f = make_train_step(model, trainer.tx, loss_cfg, trainer.schedule, trainer.shardings, 1,
                            trainer.temperature, chunk_size=64)
        with jax.set_mesh(trainer.mesh):
            c = f.lower(trainer.params, trainer.opt_state, shard_batch(long, trainer.shardings), jnp.int32(0)).compile()
        return c.memory_analysis().temp_size_in_bytes
    assert temp_bytes(remat) < temp_bytes(trainer.model)


def test_bf16_compute_keeps_fp32_master_state_and_tracks_the_fp32_update(trainer):
    """train.compute_dtype=bfloat16: the matmuls run in bf16 (they are in the compiled program), the params and
    optimizer state stay fp32, and the gradient stays close to the fp32 one."""
    loss_cfg = LossConfig()
    batch = build_batch(make_rollouts(3, 8, 4, preset("tiny").vocab_size), loss_cfg, pad_to_multiple=16)
    fn = make_train_step(trainer.model, trainer.tx, loss_cfg, trainer.schedule, trainer.shardings, 1,
                         trainer.temperature, chunk_size=64, compute_dtype=jnp.bfloat16)
    params = jax.tree.map(jnp.copy, trainer.params)
    opt_state = jax.tree.map(jnp.copy, trainer.opt_state)
    with jax.set_mesh(trainer.mesh):
        sharded = shard_batch(batch, trainer.shardings)
        hlo = fn.lower(params, opt_state, sharded, jnp.int32(0)).as_text()
        p16, o16, m16 = fn(params, opt_state, sharded, jnp.int32(0))
    p32, _, m32 = _step(trainer, loss_cfg, 1, batch)
    assert "bf16" in hlo and any("dot_general" in line and "bf16" in line for line in hlo.splitlines())
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(p16))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(o16) if jnp.issubdtype(x.dtype, jnp.floating))
    g16, g32 = float(m16["grad_norm"]), float(m32["grad_norm"])
    assert g32 > 0 and abs(g16 / g32 - 1) < 0.05, (g16, g32)
    np.testing.assert_allclose(float(m16["loss"]), float(m32["loss"]), rtol=0.05, atol=1e-3)
