"""Ulysses context parallelism: cp = 2 and cp = 4 give the loss and gradients of cp = 1, on 4 and 8 fake devices.

The compared function is the train step's own gradient path (global loss inputs, micro-batch split, the
micro-batch loss of `make_loss_fn` under `value_and_grad`, summed over micro-batches), in fp32. The tiny preset
has 4 query and 2 KV heads: cp = 2 splits the KV heads as they are, cp = 4 has fewer KV heads than devices
and takes the repeated-KV path. Besides equality, the tests check that CP really happens: the sequence dim of the
batch and of the activations is split over "cp", and the compiled step contains all-to-alls (a cp = 1 step has
none, so they are Ulysses'). The 4-device meshes use the first 4 of conftest's 8 fake devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from asyncrl.models import Model, preset
from asyncrl.sharding.axes import DATA_AXES
from asyncrl.train.batch import build_batch
from asyncrl.train.config import MeshConfig, ShardingConfig, TrainConfig
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.mesh import shard_batch
from asyncrl.train.step import make_loss_fn, split_micro_batches, with_loss_inputs
from asyncrl.train.trainer import Trainer
from tests.helpers import make_rollouts, random_params

CFG = preset("tiny")  # H=4, K=2
LOSS = LossConfig(name="grpo")
ACCUM = 2
TRAIN = TrainConfig(train_batch_size=16, grad_accum_steps=ACCUM, lr=1e-4, warmup_steps=1, pad_to_multiple=4)
T = 20  # a multiple of every cp below
ATOL = 1e-5
# LLVM's optimisation of the CPU code is most of the compile time, and nothing here measures speed. The HLO
# passes (sharding propagation, SPMD partitioning, the all-to-alls) run as usual.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _trainer(mesh: MeshConfig, n_devices: int) -> Trainer:
    t = Trainer(Model(CFG), TRAIN, LOSS, ShardingConfig(mesh=mesh, min_bytes_for_fsdp=0),
                devices=jax.devices()[:n_devices])
    t.load(random_params(CFG))
    return t


def _loss_and_grads(params, batch, model: Model):
    """`train_step` up to the optimizer: the summed micro-batch losses and gradients."""
    grad_fn = jax.value_and_grad(make_loss_fn(model, LOSS, 1.0, TRAIN.logprob_chunk_size), has_aux=True)
    batch = with_loss_inputs(batch, LOSS)
    micro = jax.tree.map(lambda x: split_micro_batches(x, ACCUM), batch)

    def body(acc, mb):
        (loss, _), g = grad_fn(params, mb)
        return jax.tree.map(jnp.add, acc, (loss, g)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    return jax.lax.scan(body, zeros, micro)[0]


def _run(trainer: Trainer, batch):
    """(loss, grads as numpy, compiled HLO text)."""
    fn = jax.jit(lambda p, b: _loss_and_grads(p, b, trainer.model))
    with jax.set_mesh(trainer.mesh):
        sharded = shard_batch(batch, trainer.shardings)
        compiled = fn.lower(trainer.params, sharded).compile(FAST_COMPILE)
        loss, grads = compiled(trainer.params, sharded)
    return float(loss), jax.tree.map(np.asarray, grads), compiled.as_text()


@pytest.fixture(scope="module")
def batch():
    return build_batch(make_rollouts(0, 4, 4, CFG.vocab_size), LOSS, seq_len=T)


@pytest.fixture(scope="module")
def reference(batch):
    """cp = 1 on 4 devices (fsdp = 4)."""
    trainer = _trainer(MeshConfig(dp=1, fsdp=4, cp_ulysses=1), 4)
    loss, grads, hlo = _run(trainer, batch)
    assert "all-to-all" not in hlo
    return loss, grads


@pytest.mark.parametrize("n_devices, mesh", [
    (4, MeshConfig(dp=1, fsdp=2, cp_ulysses=2)),
    (4, MeshConfig(dp=1, fsdp=1, cp_ulysses=4)),
    (8, MeshConfig(dp=2, fsdp=2, cp_ulysses=2)),
    (8, MeshConfig(dp=1, fsdp=2, cp_ulysses=4)),
], ids=["4dev-cp2", "4dev-cp4", "8dev-cp2", "8dev-cp4"])
def test_cp_matches_cp1(batch, reference, n_devices, mesh):
    trainer = _trainer(mesh, n_devices)
    cp = mesh.cp_ulysses
    assert trainer.mesh.shape["cp"] == cp and trainer.mesh.devices.size == n_devices

    # The batch's sequence dim is split over cp ...
    with jax.set_mesh(trainer.mesh):
        tokens = shard_batch(batch, trainer.shardings).tokens
        assert tokens.sharding.spec == P(DATA_AXES, "cp")
        assert {s.data.shape[1] for s in tokens.addressable_shards} == {T // cp}
        # ... and so is the residual stream: [B, T/cp, D] per device (it is the layer scan's carry, so every
        # layer sees that layout).
        hidden = jax.eval_shape(lambda p, t, n: trainer.model.apply(p, t, n, apply_lm_head=False)[0],
                                trainer.params, tokens, jnp.asarray(batch.seq_lens))
        assert hidden.sharding.spec == P(DATA_AXES, "cp", None)
        assert hidden.sharding.shard_shape(hidden.shape)[1] == T // cp

    loss, grads, hlo = _run(trainer, batch)
    assert "all-to-all" in hlo  # Ulysses' seq <-> heads swaps, not a silently gathered sequence
    ref_loss, ref_grads = reference
    assert abs(loss - ref_loss) <= ATOL, (loss, ref_loss)
    assert ref_loss != 0.0
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, atol=ATOL, rtol=0, err_msg=jax.tree_util.keystr(path))
    assert optax.global_norm(ref_grads) > 0


def test_cp_batch_length_must_divide():
    trainer = _trainer(MeshConfig(dp=1, fsdp=2, cp_ulysses=4), 8)
    short = build_batch(make_rollouts(0, 4, 4, CFG.vocab_size), LOSS, seq_len=18)
    with jax.set_mesh(trainer.mesh), pytest.raises(ValueError, match="train.pad_to_multiple"):
        shard_batch(short, trainer.shardings)


@pytest.mark.slow
def test_cp_trainer_steps_match_cp1(batch):
    """The whole jitted step (donation, optimizer, metrics) at dp=2 x cp=4 tracks dp=2 x fsdp=4 over two steps."""
    plain = _trainer(MeshConfig(dp=2, fsdp=4, cp_ulysses=1), 8)
    cp = _trainer(MeshConfig(dp=2, fsdp=1, cp_ulysses=4), 8)
    for _ in range(2):
        m1, m4 = plain.step(batch), cp.step(batch)
        for k in ("train/loss", "train/grad_norm", "train/entropy", "train/tokens", "train/clip_frac"):
            assert m4[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-6), k
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(plain.params), jax.tree.leaves(cp.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=0, err_msg=jax.tree_util.keystr(path))
    assert cp.compiled_step_count() == 1
