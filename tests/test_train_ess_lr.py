"""`train.ess_scaled_lr` (VCPO) and the measured group weights of the train step (`train/step.py`,
`train/ess.py`), on the tiny model in fp32: the step's update with the scaling on equals, to float rounding, the
update of the same step with the learning rate multiplied by the batch's ESS; the group sums the step returns equal
those of the proximal logprobs computed apart."""

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.models import Model, preset
from asyncrl.train.batch import build_batch
from asyncrl.train.config import MeshConfig, ShardingConfig, TrainConfig
from asyncrl.train.ess import group_weight_sums, kish_ess
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.step import token_logprobs
from asyncrl.train.trainer import Trainer
from tests.helpers import make_rollouts, random_params

LOSS = LossConfig(name="grpo")


def trainer(lr: float, scaled: bool) -> Trainer:
    t = Trainer(Model(preset("tiny")), TrainConfig(train_batch_size=32, lr=lr, grad_accum_steps=2,
                                                   ess_scaled_lr=scaled, logprob_chunk_size=64),
                LOSS, ShardingConfig(mesh=MeshConfig(dp=1, fsdp=1)), devices=jax.devices()[:1])
    t.load(random_params(preset("tiny")))
    return t


def test_ess_scaled_update_equals_the_update_at_lr_times_ess():
    batch = build_batch(make_rollouts(7, 8, 4, preset("tiny").vocab_size), LOSS, pad_to_multiple=16)
    on = trainer(3e-3, True)
    p0 = jax.tree.map(np.asarray, on.params)
    m_on = on.step(batch)
    ess = m_on["train/ess_lr_scale"]
    # The group sums the step measured: those of the params before the step against the sampler.
    lp, _ = token_logprobs(on.model, jax.tree.map(jnp.asarray, p0), jnp.asarray(batch.tokens),
                           jnp.asarray(batch.seq_lens), 1.0, 64)
    want = np.asarray(group_weight_sums(lp, jnp.asarray(batch.sampler_logprobs)[:, 1:],
                                        jnp.asarray(batch.loss_mask)[:, 1:], jnp.asarray(batch.group_ids), 32))
    np.testing.assert_allclose(on.group_weights, want, rtol=1e-5)
    assert np.all(on.group_weights[8:] == 0)  # 8 groups: ids 8..31 hold nothing
    total = want.sum(0)
    np.testing.assert_allclose(ess, kish_ess(total[0], total[1], total[2]), rtol=1e-5)
    assert 0.05 < ess < 0.99, ess  # random sampler logprobs: a real discount, not the identity
    # Off, at lr x ess: the same update, to float rounding: lr * ess * u against (lr * u) * ess (1e-5 of the
    # update), and the updated param rounded to float32 at its own magnitude (one ulp of p).
    off = trainer(3e-3 * ess, False)
    m_off = off.step(batch)
    assert "train/ess_lr_scale" not in m_off
    plain = trainer(3e-3, False)
    plain.step(batch)
    for a, b, c, p in zip(*(jax.tree.leaves(x) for x in (on.params, off.params, plain.params, p0))):
        d_on, d_off, d_plain = (np.asarray(x) - p for x in (a, b, c))
        assert np.all(np.abs(d_on - d_off) <= 1e-5 * np.abs(d_off) + np.spacing(np.abs(p))), "lr x ess"
        # ...and it is the unscaled update times ess: the factor is really applied.
        assert np.all(np.abs(d_on - ess * d_plain) <= 1e-5 * np.abs(d_on) + np.spacing(np.abs(p))), "ess x update"
