"""Several optimizer updates per rollout batch (decoupled PPO) and the KL reference, on the tiny model in fp32.

Each reference below is written out here from the definitions: the single-update step as it was before
`train.updates_per_step` existed, and k updates over strided mini-batches that all clip against proximal
logprobs computed once before the first update.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from asyncrl.models import Model, preset
from asyncrl.train.advantages import keep_sequences, loss_weights, prepare_loss_inputs
from asyncrl.train.batch import build_batch
from asyncrl.train.config import MeshConfig, ShardingConfig, TrainConfig
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.mesh import shard_batch
from asyncrl.train.registry import get_loss
from asyncrl.train.step import make_train_step, token_logprobs
from asyncrl.train.trainer import Trainer
from tests.helpers import make_rollouts, random_params

CHUNK = 64
SINGLE = ShardingConfig(mesh=MeshConfig(dp=1, fsdp=1))


def make_trainer(loss_cfg: LossConfig, **train_kw) -> Trainer:
    t = Trainer(Model(preset("tiny")), TrainConfig(**{"train_batch_size": 32, "lr": 3e-3, **train_kw}), loss_cfg,
                SINGLE, devices=jax.devices()[:1])
    t.load(random_params(preset("tiny")))
    return t


def copies(trainer: Trainer):
    return jax.tree.map(jnp.copy, trainer.params), jax.tree.map(jnp.copy, trainer.opt_state)


def strided(x: np.ndarray, n: int, j: int) -> np.ndarray:
    """Rows j, n+j, 2n+j, ...: the step's mini-batch j of n."""
    return np.asarray(x)[j::n]


# ------------------------------------------------------------------------------------ one update: today's step


def single_update_reference(trainer: Trainer, loss_cfg: LossConfig, grad_accum_steps: int):
    """The train step as it was before several updates per batch existed: advantages and weights over the whole
    batch, a scan summing value_and_grad over the micro-batches, one AdamW update. The loss is the PPO clip
    against the sampler's logprobs, written out."""
    model, tx = trainer.model, trainer.tx
    lo, hi = 1.0 - loss_cfg.epsilon_low, 1.0 + loss_cfg.epsilon_high

    def micro_loss(params, mb):
        lp, _ = token_logprobs(model, params, mb["tokens"], mb["seq_lens"], trainer.temperature, CHUNK)
        m = mb["loss_mask"][:, 1:]
        ratio = jnp.exp(jnp.where(m, lp - mb["sampler_logprobs"][:, 1:], 0.0))
        adv = mb["advantages"][:, None]
        objective = -jnp.minimum(ratio * adv, jnp.clip(ratio, lo, hi) * adv)
        return jnp.sum(mb["weights"][:, 1:] * m * objective)

    def step(params, opt_state, batch):
        adv, weights = prepare_loss_inputs(batch["rewards"], batch["group_ids"], batch["loss_mask"], loss_cfg)
        batch = batch | {"advantages": adv, "weights": weights}
        micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // grad_accum_steps, grad_accum_steps,
                                                              *x.shape[1:]), 0, 1), batch)

        def body(acc, mb):
            value, g = jax.value_and_grad(micro_loss)(params, mb)
            return jax.tree.map(jnp.add, acc, g), value

        grads, values = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), micro)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jnp.sum(values)

    return jax.jit(step)


def as_dict(batch) -> dict[str, jax.Array]:
    # A dense model's batch has no expert ids (None): the reference loop takes the arrays alone.
    return {f.name: jnp.asarray(getattr(batch, f.name)) for f in dataclasses.fields(batch)
            if getattr(batch, f.name) is not None}


def test_one_update_without_correction_is_bit_identical_to_the_single_update_step():
    loss_cfg = LossConfig(name="grpo")
    trainer = make_trainer(loss_cfg)
    batch = build_batch(make_rollouts(3, 8, 4, preset("tiny").vocab_size), loss_cfg, pad_to_multiple=16)
    fn = make_train_step(trainer.model, trainer.tx, loss_cfg, trainer.schedule, trainer.shardings, 2,
                         trainer.temperature, CHUNK)
    with jax.set_mesh(trainer.mesh):
        p1, o1, m1 = fn(*copies(trainer), shard_batch(batch, trainer.shardings), jnp.int32(0))
    p0, o0, loss0 = single_update_reference(trainer, loss_cfg, 2)(*copies(trainer), as_dict(batch))
    assert float(m1["loss"]) == float(loss0)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path((p1, o1)), jax.tree.leaves((p0, o0))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    assert float(m1["update_norm"]) > 0


# ------------------------------------------------------------------------------------ k updates: decoupled PPO


def k_update_reference(trainer: Trainer, loss_cfg: LossConfig, batch, k: int, grad_accum_steps: int):
    """k AdamW updates over the k strided mini-batches; every one clips against the proximal logprobs of the
    params before the first, its advantages are the whole batch's, its weights normalised over itself, and its
    gradient is summed over `grad_accum_steps` strided micro-batches."""
    model, tx, fn = trainer.model, trainer.tx, get_loss(loss_cfg.name)
    params, opt_state = jax.tree.map(np.asarray, copies(trainer))
    b = as_dict(batch)
    adv, _ = prepare_loss_inputs(b["rewards"], b["group_ids"], b["loss_mask"], loss_cfg)
    keep = keep_sequences(b["rewards"], b["group_ids"], loss_cfg)
    lp_of = jax.jit(lambda p, tok, lens: token_logprobs(model, p, tok, lens, trainer.temperature, CHUNK)[0])
    # [B, T-1], once, before any update; one micro-batch at a time, as the step does (the same shapes give the
    # same float rounding, which Adam's normalisation would otherwise amplify in near-zero gradient entries).
    prox = np.zeros((len(b["tokens"]), b["tokens"].shape[1] - 1), np.float32)
    n = k * grad_accum_steps
    for c in range(n):
        prox[c::n] = lp_of(params, strided(b["tokens"], n, c), strided(b["seq_lens"], n, c))

    def loss(p, micro):
        lp = token_logprobs(model, p, micro["tokens"], micro["seq_lens"], trainer.temperature, CHUNK)[0]
        return fn(lp, micro["sampler_logprobs"][:, 1:], micro["adv"], micro["w"][:, 1:], micro["loss_mask"][:, 1:],
                  loss_cfg, prox_logprobs=micro["prox"])

    @jax.jit
    def update(p, o, micros):
        def body(acc, micro):
            (_, m), g = jax.value_and_grad(loss, has_aux=True)(p, micro)
            return jax.tree.map(jnp.add, acc, g), m

        stacked = jax.tree.map(lambda *x: jnp.stack(x), *micros)
        grads, metrics = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, p), stacked)
        u, o = tx.update(grads, o, p)
        return optax.apply_updates(p, u), o, jax.tree.map(lambda x: jnp.sum(x, axis=0), metrics)

    clip_fracs, clipped, tokens = [], 0.0, 0.0
    for j in range(k):
        mini = {key: strided(b[key], k, j) for key in ("tokens", "seq_lens", "sampler_logprobs", "loss_mask")}
        mini |= {"adv": strided(adv, k, j), "prox": strided(prox, k, j),
                 "w": loss_weights(mini["loss_mask"], loss_cfg, strided(keep, k, j))}
        micros = [{key: strided(v, grad_accum_steps, g) for key, v in mini.items()} for g in range(grad_accum_steps)]
        params, opt_state, metrics = update(params, opt_state, micros)
        clip_fracs.append(float(metrics["clip_tokens"] / metrics["token_count"]))
        clipped += float(metrics["clip_tokens"])
        tokens += float(metrics["token_count"])
    return params, opt_state, clip_fracs, clipped / tokens


@pytest.mark.parametrize("correction", [None, "truncate"])
def test_four_updates_equal_a_reference_loop_against_one_proximal_policy(correction):
    loss_cfg = LossConfig(name="grpo", tis_cap=2.0 if correction else None)
    trainer = make_trainer(loss_cfg, updates_per_step=4)
    batch = build_batch(make_rollouts(5, 8, 4, preset("tiny").vocab_size), loss_cfg, pad_to_multiple=16)
    fn = make_train_step(trainer.model, trainer.tx, loss_cfg, trainer.schedule, trainer.shardings, 2,
                         trainer.temperature, CHUNK, updates_per_step=4)
    with jax.set_mesh(trainer.mesh):
        p4, o4, m4 = fn(*copies(trainer), shard_batch(batch, trainer.shardings), jnp.int32(0))
    want_p, want_o, clip_fracs, clip_frac = k_update_reference(trainer, loss_cfg, batch, 4, 2)
    diffs = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves((p4, o4)), jax.tree.leaves((want_p, want_o)))]
    assert max(diffs) <= 1e-5, max(diffs)
    # The first update is taken at the proximal params (ratio 1, no clipping); the ratio then moves.
    assert clip_fracs[0] == 0.0 and all(f > 0 for f in clip_fracs[1:]), clip_fracs
    np.testing.assert_allclose(float(m4["clip_frac"]), clip_frac, rtol=1e-6)
    if correction:
        assert 0 < float(m4["is_truncated_frac"]) < 1  # the random sampler logprobs sit on both sides of the cap


def test_updates_per_step_validation_and_schedule():
    with pytest.raises(ValueError, match=r"train\.updates_per_step=3"):
        TrainConfig(train_batch_size=32, updates_per_step=3)
    with pytest.raises(ValueError, match=r"train\.updates_per_step=4.*grad_accum_steps=4"):
        TrainConfig(train_batch_size=24, updates_per_step=4, grad_accum_steps=4)
    from asyncrl.train.optimizer import lr_schedule

    one = lr_schedule(TrainConfig(lr=1.0, warmup_steps=2, total_steps=10))
    four = lr_schedule(TrainConfig(lr=1.0, warmup_steps=2, total_steps=10, updates_per_step=4))
    # The schedule counts updates: step s of a 4-update run is updates 4s .. 4s+3, where a 1-update run is at s.
    # Warm-up ramps per update, reaching a 1-update run's value at the step's last update.
    for s in (0, 1):
        np.testing.assert_allclose(float(four(4 * s + 3)), float(one(s)), rtol=1e-6)
    for s in (2, 5, 9):
        np.testing.assert_allclose(float(four(4 * s)), float(one(s)), rtol=1e-6)


# ------------------------------------------------------------------------------------ KL to the reference


@pytest.mark.parametrize("ref_offload", [False, True])
def test_kl_to_the_initial_params_rises_from_zero(ref_offload):
    loss_cfg = LossConfig(name="grpo", kl_coef=0.05)
    trainer = make_trainer(loss_cfg, ref_offload=ref_offload)
    if ref_offload:  # the CPU has pinned host memory too, so the offloaded path runs here
        assert {s.memory_kind for s in jax.tree.leaves(trainer.ref_shardings)} == {"pinned_host"}
        assert {x.sharding.memory_kind for x in jax.tree.leaves(trainer.ref_params)} == {"pinned_host"}
    ref_before = jax.tree.map(np.asarray, trainer.ref_params)
    kls = []
    for step in range(4):
        batch = build_batch(make_rollouts(10 + step, 8, 4, preset("tiny").vocab_size), loss_cfg,
                            pad_to_multiple=16)
        kls.append(trainer.step(batch)["train/kl"])
    assert abs(kls[0]) < 1e-6, kls  # the first step's params are the reference
    assert kls[1] > 1e-4 and kls[3] > kls[1], kls
    # The reference stays the initial params; the policy has moved away from it.
    for a, b in zip(jax.tree.leaves(ref_before), jax.tree.leaves(trainer.ref_params)):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_kl_gradient_matches_finite_differences():
    """d/d eps of the step's loss at params + eps * v, with advantages 0 so that only the KL term is left: the
    gradient (through the fused logprobs' custom VJP) dotted with v, against a central difference."""
    from asyncrl.train.step import frozen_logprobs, make_loss_fn, with_loss_inputs

    loss_cfg = LossConfig(name="grpo", kl_coef=1.0)
    model = Model(preset("tiny"))
    params = jax.tree.map(jnp.asarray, random_params(preset("tiny"), 0))
    ref = jax.tree.map(lambda p, q: p + 0.3 * jnp.asarray(q), params, random_params(preset("tiny"), 1))
    direction = jax.tree.map(jnp.asarray, random_params(preset("tiny"), 2))
    batch = build_batch(make_rollouts(4, 4, 4, preset("tiny").vocab_size), loss_cfg, pad_to_multiple=16)
    batch = with_loss_inputs(jax.tree.map(jnp.asarray, batch), loss_cfg)
    batch = dataclasses.replace(batch, advantages=jnp.zeros_like(batch.advantages))
    frozen = {"ref": frozen_logprobs(model, ref, batch, 1, 1, 1.0, CHUNK)[0, 0]}
    loss = make_loss_fn(model, loss_cfg, 1.0, CHUNK)
    f = jax.jit(lambda eps: loss(jax.tree.map(lambda p, v: p + eps * v, params, direction), batch, frozen)[0])
    value, grads = jax.jit(jax.value_and_grad(lambda p: loss(p, batch, frozen)[0]))(params)
    slope = sum(jnp.vdot(g, v) for g, v in zip(jax.tree.leaves(grads), jax.tree.leaves(direction)))
    h = 3e-3
    fd = (float(f(jnp.float32(h))) - float(f(jnp.float32(-h)))) / (2 * h)
    assert float(value) > 1e-3
    # fp32 central difference: O(h^2) truncation (measured 5e-4 relative at this h, 6e-3 at h=1e-2) plus
    # ~1e-7 * |f| / h of rounding (~1e-4 relative).
    np.testing.assert_allclose(float(slope), fd, rtol=2e-3)
