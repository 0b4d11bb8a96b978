"""LoRA in the trainer: adapter-only optimizer state and updates, a frozen base that is the KL reference, the
full fine-tune unchanged at rank 0, and the sharded step equal to the single-device one."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.models import Model, lora, preset
from asyncrl.train.batch import build_batch
from asyncrl.train.config import LoraConfig, MeshConfig, ShardingConfig, TrainConfig
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.mesh import shard_batch
from asyncrl.train.step import make_loss_fn, with_loss_inputs
from asyncrl.train.trainer import Trainer
from asyncrl.validate import ConfigError
from tests.helpers import make_rollouts, random_params

TRAIN = TrainConfig(train_batch_size=32, grad_accum_steps=2, lr=1e-3, warmup_steps=1, weight_decay=0.1)
LORA = LoraConfig(rank=4, alpha=8.0)


def _trainer(train=TRAIN, loss=LossConfig(name="grpo"), mesh=MeshConfig(dp=1, fsdp=1), devices=None):
    t = Trainer(Model(preset("tiny")), train, loss, ShardingConfig(mesh=mesh, min_bytes_for_fsdp=0),
                devices=jax.devices()[:1] if devices is None and mesh.dp * mesh.fsdp == 1 else devices)
    t.load(random_params(preset("tiny")))
    return t


def _batches(loss=LossConfig(name="grpo")):
    vocab = preset("tiny").vocab_size
    return [build_batch(make_rollouts(seed, 8, 4, vocab), loss, seq_len=16) for seed in (0, 1)]


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def test_rank_zero_is_the_full_fine_tune_bit_for_bit():
    a = _trainer()
    b = _trainer(dataclasses.replace(TRAIN, lora=LoraConfig(rank=0, alpha=3.0, targets=["q"])))
    assert b.lora is None and b.base is None
    for batch in _batches():
        ma, mb = a.step(batch), b.step(batch)
        assert {k: v for k, v in ma.items() if k != "train/step_time_s"} == \
               {k: v for k, v in mb.items() if k != "train/step_time_s"}
    for x, y in zip(jax.tree.leaves(_host(a.params)), jax.tree.leaves(_host(b.params))):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(jax.tree.leaves(_host(a.opt_state)), jax.tree.leaves(_host(b.opt_state))):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("kl,updates", [(0.0, 1), (0.1, 1), (0.1, 2)])
def test_only_the_adapters_train_and_the_base_is_the_reference(kl, updates):
    loss = LossConfig(name="grpo", kl_coef=kl)
    t = _trainer(dataclasses.replace(TRAIN, lora=LORA, updates_per_step=updates), loss)
    start = _host(t.base)
    assert t.ref_params is None  # no second copy: the reference is the base
    n_adapters = lora.count(t.model.cfg, 4, LORA.targets)
    assert sum(x.size for x in jax.tree.leaves(t.params)) == n_adapters
    # Adam's two moments, over the adapters only.
    assert sum(x.size for x in jax.tree.leaves(t.opt_state) if x.ndim > 0) == 2 * n_adapters
    assert all(float(jnp.abs(p["b"]).max()) == 0 for p in t.params.values())  # starts at the base
    merged0 = _host(t.params_for_inference(jnp.float32))
    for x, y in zip(jax.tree.leaves(merged0), jax.tree.leaves(start)):
        np.testing.assert_array_equal(x, y)
    metrics = [t.step(b, None) for b in _batches(loss)]
    for x, y in zip(jax.tree.leaves(_host(t.base)), jax.tree.leaves(start)):
        np.testing.assert_array_equal(x, y)  # frozen
    assert all(float(jnp.abs(p["b"]).max()) > 0 for p in t.params.values())
    assert all(np.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0 for m in metrics)
    if kl:  # the first step starts at the reference (KL 0: one update); the second has moved away from it
        assert (abs(metrics[0]["train/kl"]) < 1e-6 or updates > 1) and metrics[1]["train/kl"] > 0
    # The merged inference copy is the base plus scale * A B.
    merged = _host(t.params_for_inference(jnp.float32))
    ad = _host(t.params)
    want = start["layers"] if isinstance(start, dict) else start.layers
    d = np.einsum("ldr,lrhk->ldhk", ad["wq"]["a"], ad["wq"]["b"]) * LORA.scale
    np.testing.assert_allclose(merged.layers.wq, want.wq + d, atol=1e-6)


def test_sync_payload_carries_the_base_only_when_full():
    t = _trainer(dataclasses.replace(TRAIN, lora=LORA))
    full, light = t.sync_payload(jnp.bfloat16, True), t.sync_payload(jnp.bfloat16, False)
    assert set(full) == {"adapters", "base"} and set(light) == {"adapters"}
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(full["base"]))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(light["adapters"]))
    for x, y in zip(jax.tree.leaves(light["adapters"]), jax.tree.leaves(t.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y.astype(jnp.bfloat16)))
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    assert nbytes(light) < nbytes(full["base"]) / 5


def test_freeze_a_trains_b_alone_and_syncs_b_alone_after_the_first():
    """LoRA-FA. With B = 0 at the start, A's gradient (x^T dy B^T) is exactly 0 on the first step, so the first
    update of B must equal the both-factors run's; A itself must stay bit for bit at its init (the both-factors
    run's weight decay moves it), with no optimizer state; and a sync after the first carries B alone."""
    free = _trainer(dataclasses.replace(TRAIN, lora=LORA))
    fa = _trainer(dataclasses.replace(TRAIN, lora=dataclasses.replace(LORA, freeze_a=True)))
    a0 = _host(fa.params)
    n_b = lora.count(fa.model.cfg, 4, LORA.targets, ("b",))
    assert sum(x.size for x in jax.tree.leaves(fa.opt_state) if x.ndim > 0) == 2 * n_b  # Adam's moments of B only
    batch = _batches()[0]
    m_free, m_fa = free.step(batch), fa.step(batch)
    assert m_fa["train/grad_norm"] == pytest.approx(m_free["train/grad_norm"], rel=1e-6)
    got, want = _host(fa.params), _host(free.params)
    for f in got:
        np.testing.assert_array_equal(got[f]["a"], a0[f]["a"])
        assert not np.array_equal(want[f]["a"], a0[f]["a"])  # decayed in the both-factors run
        np.testing.assert_allclose(got[f]["b"], want[f]["b"], rtol=1e-5, atol=1e-7)
    fa.step(_batches()[1])
    for f, pair in _host(fa.params).items():
        np.testing.assert_array_equal(pair["a"], a0[f]["a"])
    full, light = fa.sync_payload(jnp.bfloat16, True), fa.sync_payload(jnp.bfloat16, False)
    assert all(set(p) == {"a", "b"} for p in full["adapters"].values())
    assert all(set(p) == {"b"} for p in light["adapters"].values())
    assert sum(x.size for x in jax.tree.leaves(light)) == n_b


def test_lora_step_matches_the_gradient_of_the_adapted_model():
    """The trainer's update direction is the gradient of the loss of the base with the adapters attached."""
    t = _trainer(dataclasses.replace(TRAIN, lora=LORA, grad_accum_steps=1, max_grad_norm=0.0, weight_decay=0.0))
    t.step(_batches()[0])  # B != 0 from here on
    loss = LossConfig(name="grpo")
    batch = _batches()[1]
    fn = make_loss_fn(t.model, loss, t.temperature, TRAIN.logprob_chunk_size)
    with jax.set_mesh(t.mesh):
        g = jax.jit(jax.grad(lambda a, b: fn(lora.attach(t.base, a, LORA.scale), with_loss_inputs(b, loss))[0]))(
            t.params, shard_batch(batch, t.shardings))
    m = t.step(batch)
    np.testing.assert_allclose(m["train/grad_norm"], float(np.sqrt(sum(np.sum(np.asarray(x) ** 2)
                                                                       for x in jax.tree.leaves(g)))), rtol=1e-5)


def test_sharded_lora_step_matches_single_device():
    assert jax.device_count() == 8
    train = dataclasses.replace(TRAIN, lora=LORA, lr=1e-4)
    single = _trainer(train)
    sharded = _trainer(train, mesh=MeshConfig(dp=2, fsdp=4), devices=jax.devices())
    a = sharded.params["w_down"]["b"]  # [L, r, D]: D split over fsdp
    assert a.sharding.spec[2] == "fsdp" and len(a.addressable_shards) == 8
    for b in _batches():
        ms, mh = single.step(b), sharded.step(b)
        for k in ("train/loss", "train/grad_norm"):
            np.testing.assert_allclose(mh[k], ms[k], rtol=1e-4, atol=1e-6, err_msg=k)
    for x, y in zip(jax.tree.leaves(_host(single.params)), jax.tree.leaves(_host(sharded.params))):
        np.testing.assert_allclose(y, x, atol=1e-5, rtol=0)


def test_bad_lora_config_names_the_field():
    with pytest.raises(ConfigError, match="train.lora.targets"):
        LoraConfig(rank=4, targets=["q", "attn"])
    with pytest.raises(ConfigError, match="train.lora.rank"):
        LoraConfig(rank=-1)


def test_the_config_names_the_same_targets_as_the_model():
    """The config keeps its own copy of the target names (it must not import jax); both lists must agree, in order."""
    from asyncrl.train.config import LORA_TARGETS

    assert tuple(LORA_TARGETS) == tuple(lora.TARGETS)
