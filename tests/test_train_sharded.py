"""A train step on 8 fake CPU devices (dp=2 x fsdp=4, Explicit axes) equals the single-device step.

Adam's first update is about lr * sign(grad), which hides a gradient that is wrong by a constant factor: so
`grad_norm` is among the compared metrics, two steps on different batches are taken (the second update depends on
per-element gradient magnitudes), and a slow test compares the gradients themselves. The learning rate is small
enough that Adam's amplification of fp32 noise in near-zero gradient entries (|g| ~ eps) stays below 1e-5.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from asyncrl.models import Model, preset
from asyncrl.train.batch import build_batch
from asyncrl.train.config import MeshConfig, ShardingConfig, TrainConfig
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.mesh import shard_batch
from asyncrl.train.step import make_loss_fn, with_loss_inputs
from asyncrl.train.trainer import Trainer
from tests.helpers import make_rollouts, random_params

TRAIN = TrainConfig(train_batch_size=32, grad_accum_steps=2, lr=1e-4, warmup_steps=1, weight_decay=0.1)
LOSS = LossConfig(name="grpo")


def _trainer(mesh: MeshConfig, devices=None, model: str = "tiny", **sharding) -> Trainer:
    t = Trainer(Model(preset(model)), TRAIN, LOSS, ShardingConfig(mesh=mesh, min_bytes_for_fsdp=0, **sharding),
                devices=devices)
    t.load(random_params(preset(model)))
    return t


def _grads(trainer: Trainer, batch):
    loss_fn = make_loss_fn(trainer.model, LOSS, trainer.temperature, TRAIN.logprob_chunk_size)
    with jax.set_mesh(trainer.mesh):
        g = jax.jit(jax.grad(lambda p, b: loss_fn(p, with_loss_inputs(b, LOSS))[0]))(
            trainer.params, shard_batch(batch, trainer.shardings))
    return jax.tree.map(np.asarray, g)


def _assert_trees_close(a, b, atol):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0, err_msg=jax.tree_util.keystr(path))


def _batches():
    vocab = preset("tiny").vocab_size
    return [build_batch(make_rollouts(seed, 8, 4, vocab), LOSS, seq_len=16) for seed in (0, 1)]


def _assert_steps_match(single: Trainer, sharded: Trainer, batch) -> None:
    m1, m8 = single.step(batch), sharded.step(batch)
    for m in (m1, m8):
        m.pop("train/step_time_s")
    assert m1.keys() == m8.keys()
    for k in m1:
        assert m8[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-6), k
    _assert_trees_close(single.params, sharded.params, atol=1e-5)


def test_fsdp_dp_step_matches_single_device():
    assert jax.device_count() == 8
    batches = _batches()
    single = _trainer(MeshConfig(dp=1, fsdp=1), devices=jax.devices()[:1])
    sharded = _trainer(MeshConfig(dp=2, fsdp=4))
    assert sharded.mesh.shape == {"dp": 2, "fsdp": 4, "expert": 1, "cp": 1}

    # Really sharded: FSDP splits D (=64) 4 ways and replicates over dp; so do Adam's moments.
    wq, embed = sharded.params.layers.wq, sharded.params.embed  # [L, D, H, Dh], [V, D]
    assert len(wq.addressable_shards) == 8
    assert {s.data.shape for s in wq.addressable_shards} == {(wq.shape[0], 16, *wq.shape[2:])}
    assert {s.data.shape for s in embed.addressable_shards} == {(embed.shape[0], 16)}
    assert {s.data.shape for s in sharded.params.final_norm.addressable_shards} == {(64,)}
    moments = [x for x in jax.tree.leaves(sharded.opt_state) if x.shape == wq.shape]
    assert len(moments) == 2 and all(m.sharding == wq.sharding for m in moments)

    for batch in batches:
        m1, m8 = single.step(batch), sharded.step(batch)
        for m in (m1, m8):
            m.pop("train/step_time_s")
        assert m1.keys() == m8.keys()
        assert {"train/loss", "train/grad_norm", "train/lr", "train/entropy", "train/tokens", "train/is_ratio_min",
                "train/clip_frac"} <= m1.keys()
        for k in m1:
            assert m8[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-6), k
        assert m1["train/tokens"] == float(batch.seq_lens.sum())
        assert m1["train/token_count"] == float(batch.loss_mask.sum())
        _assert_trees_close(single.params, sharded.params, atol=1e-5)
    assert {s.data.shape for s in sharded.params.layers.wq.addressable_shards} == {(wq.shape[0], 16, *wq.shape[2:])}
    assert single.version == sharded.version == 2
    assert single.compiled_step_count() == sharded.compiled_step_count() == 1


@pytest.mark.slow
def test_fsdp_dp_gradients_match_single_device():
    batch = _batches()[0]
    single = _trainer(MeshConfig(dp=1, fsdp=1), devices=jax.devices()[:1])
    sharded = _trainer(MeshConfig(dp=2, fsdp=4))
    _assert_trees_close(_grads(single, batch), _grads(sharded, batch), atol=1e-6)


@pytest.mark.slow
def test_opt_state_offload_matches():
    """Optimizer state kept in pinned host memory (CPU has it) trains exactly like device-resident state."""
    batch = _batches()[0]
    plain = _trainer(MeshConfig(dp=2, fsdp=4))
    offload = _trainer(MeshConfig(dp=2, fsdp=4), opt_state_offload=True)
    assert offload.shardings.offloaded
    for _ in range(2):
        plain.step(batch)
        offload.step(batch)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(offload.opt_state)} == {"pinned_host"}
    _assert_trees_close(plain.params, offload.params, atol=0)


@pytest.mark.slow
def test_two_updates_with_correction_kl_and_offload_match_single_device():
    """The k-update path (proximal and reference logprobs, per-mini-batch weights, the update scan) under
    Explicit dp x fsdp sharding, with optimizer state and KL reference in pinned host memory, equals one device."""
    # Twice the updates of the test above, so half its learning rate: the same bound on Adam's amplification of
    # fp32 noise in near-zero gradient entries (see the module docstring).
    train = TrainConfig(train_batch_size=32, grad_accum_steps=2, updates_per_step=2, lr=5e-5, warmup_steps=1,
                        ref_offload=True)
    loss = LossConfig(name="grpo", tis_cap=2.0, kl_coef=0.1)

    def make(mesh, devices=None, **sharding):
        t = Trainer(Model(preset("tiny")), train, loss, ShardingConfig(mesh=mesh, min_bytes_for_fsdp=0, **sharding),
                    devices=devices)
        t.load(random_params(preset("tiny")))
        return t

    single = make(MeshConfig(dp=1, fsdp=1), devices=jax.devices()[:1])
    sharded = make(MeshConfig(dp=2, fsdp=4), opt_state_offload=True)
    assert sharded.shardings.offloaded
    assert {x.sharding.memory_kind for x in jax.tree.leaves(sharded.ref_params)} == {"pinned_host"}
    for batch in [build_batch(make_rollouts(seed, 8, 4, preset("tiny").vocab_size), loss, seq_len=16)
                  for seed in (0, 1)]:
        m1, m8 = single.step(batch), sharded.step(batch)
        for k in m1.keys() - {"train/step_time_s"}:
            assert m8[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-6), k
        assert m1["train/kl"] >= 0 and 0 < m1["train/is_truncated_frac"] < 1
        _assert_trees_close(single.params, sharded.params, atol=1e-5)


@pytest.mark.slow
def test_moe_dp_fsdp_expert_steps_match_single_device_and_sync_to_a_tensor_parallel_replica():
    """The tiny MoE's train step (loss, gradients, AdamW update) under dp x fsdp x expert = 2 x 2 x 2 equals one
    device's, with the experts really split over the expert axis; the trained weights then go from the trainer's
    layout straight onto an inference replica's tensor-parallel one (what a weight sync's receiver does:
    `place_params`). That layout's forward is tests/test_moe.py's expert_tp case."""
    from jax.sharding import AxisType, Mesh

    from asyncrl.inference.weights import place_params
    from asyncrl.sharding.rules import tensor_parallel_rules

    cfg = preset("tiny_moe")
    batches = [build_batch(make_rollouts(seed, 8, 4, cfg.vocab_size), LOSS, seq_len=16) for seed in (0, 1)]
    single = _trainer(MeshConfig(dp=1, fsdp=1), devices=jax.devices()[:1], model="tiny_moe")
    sharded = _trainer(MeshConfig(dp=2, fsdp=2, expert=2), model="tiny_moe")
    assert sharded.mesh.shape == {"dp": 2, "fsdp": 2, "expert": 2, "cp": 1}
    wg = sharded.params.layers.moe.w_gate  # [L, E, D, I] = [2, 4, 64, 48]: E over expert, D over fsdp
    assert {s.data.shape for s in wg.addressable_shards} == {(2, 2, 32, 48)}
    moments = [x for x in jax.tree.leaves(sharded.opt_state) if x.shape == wg.shape]
    assert len(moments) == 4 and all(m.sharding == wg.sharding for m in moments)  # mu, nu of w_gate and w_up
    for batch in batches:
        _assert_steps_match(single, sharded, batch)
    assert {s.data.shape for s in sharded.params.layers.moe.w_gate.addressable_shards} == {(2, 2, 32, 48)}
    start = random_params(cfg).layers.moe
    for name in ("router", "w_gate", "w_down"):  # the experts and the router really trained
        assert float(np.abs(np.asarray(getattr(single.params.layers.moe, name)) - getattr(start, name)).max()) > 1e-5

    mesh = Mesh(np.asarray(jax.devices()[:2]), ("tp",), axis_types=(AxisType.Explicit,))
    replica = place_params(sharded.params_for_inference(np.float32),
                           Model(cfg, tensor_parallel_rules("tp")).param_shardings(mesh))
    assert {s.data.shape for s in replica.layers.moe.w_gate.addressable_shards} == {(2, 4, 64, 24)}  # I over tp
    _assert_trees_close(replica, single.params, atol=1e-5)
