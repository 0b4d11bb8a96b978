"""Router replay end to end (train.moe.router_replay) and the load-balancing loss in the train step, on tiny_moe
(4 experts, top-2, layers 1-2 MoE): the engine records each sampled token's experts, the rollout carries them into
the trainer's batch, and the trainer's forward (policy and proximal passes) routes by them.

The sampler's routing is made to differ from the trainer's the way bf16 near-ties make it differ in practice: the
router columns of experts 2 and 3 are equal (an exact tie, which both sides break towards expert 2), and a weight
update landing inside the completions moves expert 3's column by 1e-6. Tokens sampled after it pick expert 3
wherever the pair straddles the top-2 boundary; the trainer (the weights before the update) picks expert 2 there
unless it replays. A 1e-6 move changes the logprobs themselves by far less than 1e-4: any larger gap is routing.
(Even before the update, the decode step and the trainer's full forward break the exact tie differently at a few
tokens: the kernels' last bits differ, as bf16 near-ties do at scale.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.inference.config import InferenceConfig
from asyncrl.inference.engine import Engine, Request
from asyncrl.inference.layout import Layout
from asyncrl.models import Model, preset
from asyncrl.rollout import Prompt
from asyncrl.train.batch import build_batch
from asyncrl.train.config import MoeConfig, ShardingConfig, TrainConfig
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.step import frozen_logprobs, token_logprobs
from asyncrl.train.trainer import Trainer

MODEL = Model(preset("tiny_moe"))
CFG = InferenceConfig(group_size=2, max_decode_batch_size=4, max_prefill_prompts=4, max_seq_len=48,
                      temperature=1.0, params_dtype="float32", kv_cache_dtype="float32", min_prefill_bucket=8,
                      decode_chunk_steps=3)
TEXTS = ["3 1 4 1 5>", "9 2 6>"]
LOSS = LossConfig(name="grpo")
CHUNK = 1024


def _tied(params, eps=0.0):
    """Every MoE layer's router column 3 set to column 2's (+ eps * noise): experts 2 and 3 tie (eps 0), or nearly."""
    r = params.layers.moe.router  # [Lm, D, E]
    col = r[..., 2] + eps * jax.random.normal(jax.random.PRNGKey(9), r[..., 2].shape)
    p = jax.tree.map(lambda w: w, params)
    p.layers.moe = dataclasses.replace(params.layers.moe, router=r.at[..., 3].set(col))
    return p


@pytest.fixture(scope="module")
def sampled(tok):
    """(trainer weights, rollouts with a weight update inside completions, their RLBatch): 2 prompts x 2 samples."""
    params = _tied(MODEL.init_params(jax.random.PRNGKey(0)))
    moved = _tied(params, 1e-6)
    eng = Engine(MODEL, params, CFG, tok, seed=2, record_routes=True)
    calls = {"n": 0}

    def hook():  # as tests/test_moe_engine.py: the first calls fill the batch, then each runs up to 3 decode steps
        calls["n"] += 1
        if calls["n"] == 6:
            eng.set_params(moved, 1)

    eng.between_loops = hook
    out = eng.generate([Request(Prompt(i, t, 2), tok.encode(t)) for i, t in enumerate(TEXTS)], drain=True)
    for r in out:
        for c in r.completions:
            c.reward = float(c.tokens[0] % 2)
    return params, out, build_batch(out, LOSS)


def test_recorded_routes_reach_the_trainer_and_replay_makes_its_routing_the_samplers(sampled):
    """(a) Every fed model token's record reaches the batch (int8, Lm x k bytes a token; -1 elsewhere), the trainer's
    own routing equals it before the update (the record is aligned), differs after it, and replayed equals it."""
    params, out, batch = sampled
    ids = batch.expert_ids
    Lm, k = len(MODEL.cfg.sparse_layers), MODEL.cfg.num_experts_per_tok
    assert ids.dtype == np.int8 and ids.shape == (*batch.tokens.shape, Lm, k)
    recorded = ids[..., 0, 0] >= 0  # [B, T]
    fed = np.zeros_like(recorded)
    after = np.zeros_like(recorded)
    for b, (r, c) in enumerate((g, c) for g in out for c in g.completions):
        p, n = len(r.prompt_tokens), len(c.tokens)
        assert c.routes.shape == (n, Lm, k) and c.routes.nbytes == n * Lm * k * 1  # 1 byte an id (E <= 128)
        fed[b, p:p + n - 1] = ~c.forced[:-1]  # every sampled token but the last is fed back, and recorded
        after[b, p:p + n - 1] = c.versions[:-1] == 1
    np.testing.assert_array_equal(recorded, fed)
    assert ((ids >= 0) == recorded[..., None, None]).all()
    assert after.sum() >= 10 and (recorded & ~after).sum() >= 10, "tokens on both sides of the update"

    tokens, lens = jnp.asarray(batch.tokens), jnp.asarray(batch.seq_lens)
    routing = jax.jit(lambda p, t, n, i=None: MODEL.apply_routed(p, t, n, apply_lm_head=False, expert_ids=i)[2])
    own, replayed = routing(params, tokens, lens), routing(params, tokens, lens, jnp.asarray(ids))
    same = lambda a, b, m: np.all(np.sort(np.asarray(a), -1)[m] == np.sort(b, -1)[m], axis=-1)  # noqa: E731  [N, Lm]
    # The same weights route the same, up to the exact tie, which the decode step's kernels and the full forward
    # break differently at a few tokens: the record sits at its tokens.
    untie = lambda x: np.where(np.asarray(x) == 3, 2, np.asarray(x))  # noqa: E731
    assert same(untie(own), untie(ids), recorded & ~after).all()
    rerouted = 1 - same(own, ids, after).mean()
    assert rerouted > 0.05, rerouted  # the moved router's choices differ from the trainer's own
    np.testing.assert_array_equal(np.asarray(replayed)[recorded], ids[recorded])


def test_replayed_logprobs_equal_the_samplers_in_the_policy_and_proximal_passes(sampled):
    """(b) The step's policy pass (`token_logprobs`) and proximal pass (`frozen_logprobs`) with the batch's routes
    score every sampled token as the sampler did (fp32, <= 1e-4); without the routes they do not."""
    params, _, batch = sampled
    mask = batch.loss_mask[:, 1:]
    want = batch.sampler_logprobs[:, 1:]
    tokens, lens, ids = jnp.asarray(batch.tokens), jnp.asarray(batch.seq_lens), jnp.asarray(batch.expert_ids)
    policy = jax.jit(lambda p, t, n, i=None: token_logprobs(MODEL, p, t, n, 1.0, CHUNK, i)[0])
    lp = policy(params, tokens, lens, ids)
    np.testing.assert_allclose(np.asarray(lp)[mask], want[mask], atol=1e-4)
    prox = jax.jit(lambda p, b: frozen_logprobs(MODEL, p, b, 1, 1, 1.0, CHUNK))(params, jax.tree.map(jnp.asarray,
                                                                                                      batch))[0, 0]
    np.testing.assert_allclose(np.asarray(prox)[mask], want[mask], atol=1e-4)
    free = policy(params, tokens, lens)
    gap = np.abs(np.asarray(free)[mask] - want[mask])
    print(f"|trainer - sampler| logprob: replay max {np.abs(np.asarray(lp)[mask] - want[mask]).max():.1e}, "
          f"without max {gap.max():.3f} mean {gap.mean():.4f}")
    assert gap.max() > 1e-2


def test_train_step_replays_and_logs_the_load_balancing_loss(sampled):
    """The trainer's step on the batch, replay and aux_coef on: it logs the aux loss and the experts' load. A replay
    trainer refuses a batch without routes, naming the field."""
    params, _, batch = sampled
    train = TrainConfig(train_batch_size=4, lr=1e-4, moe=MoeConfig(router_replay=True, aux_coef=0.01))
    trainer = Trainer(MODEL, train, LOSS, ShardingConfig(), devices=jax.devices()[:1])
    trainer.load(params)
    m = trainer.step(batch)
    E, k = MODEL.cfg.num_experts, MODEL.cfg.num_experts_per_tok
    assert np.isfinite(m["train/loss"]) and m["train/moe_aux_loss"] >= k * 0.999  # k at a perfect balance
    assert 0 < m["train/moe_load_min"] <= 1 / E <= m["train/moe_load_max"] < 1
    with pytest.raises(ValueError, match="train.moe.router_replay=true"):
        trainer.step(dataclasses.replace(batch, expert_ids=None))


def test_dense_and_replay_off_record_nothing(tok):
    """(d) Dense models and replay off: no routes in the decode state, so the programs are today's."""
    assert Layout(Model(preset("tiny")), CFG, None, 0, record_routes=True).route_width == 0
    lay = Layout(MODEL, CFG, None, 0)
    assert lay.route_width == 0 and lay.empty(2, jnp.zeros((2,), jnp.uint32)).routes is None
    assert Layout(MODEL, CFG, None, 0, record_routes=True).route_width == 4  # Lm x k
