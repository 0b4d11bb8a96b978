"""The inference engine on a mixture-of-experts model (tiny_moe: 4 experts, top-2, layer 0 dense): prefill and decode
with continuous batching, multi-turn continuations, and in-flight weight updates, against full-forward references."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.inference.config import InferenceConfig
from asyncrl.inference.engine import Engine, Request
from asyncrl.inference.replicas import ReplicaSet
from asyncrl.models import Model, preset
from asyncrl.rollout import Prompt, StepResult

BASE = InferenceConfig(group_size=2, max_decode_batch_size=4, max_prefill_prompts=4, max_seq_len=48,
                       temperature=1.0, params_dtype="float32", kv_cache_dtype="float32", min_prefill_bucket=8)
TEXTS = ["3 1 4 1 5>", "9 2 6>", "5 3 5 8 9 7 9>", "3 2>", "8 4 6 2 6 4 3 3>", "8 3 2 7 9>"]


@pytest.fixture(scope="module")
def moe_params():
    model = Model(preset("tiny_moe"))
    return model, model.init_params(jax.random.PRNGKey(0))


def _requests(tok, n=6, k=2, envs=None):
    return [Request(Prompt(i, t, k), tok.encode(t), None if envs is None else envs(tok.encode(t), k))
            for i, t in enumerate(TEXTS[:n])]


def _greedy_reference(model, params, prompt, n, width=32):
    """n greedy tokens, each from a full forward pass over everything so far (no cache). The input is padded to one
    width, so the pass compiles once (a length per token cost this test 3 minutes); causal attention and per-token
    routing leave every position before the padding as it was."""
    forward = jax.jit(model.apply)
    ids = list(prompt)
    assert len(ids) + n <= width
    for _ in range(n):
        padded = np.zeros((1, width), np.int32)
        padded[0, :len(ids)] = ids
        logits, _ = forward(params, jnp.asarray(padded), jnp.asarray([len(ids)]))
        ids.append(int(jnp.argmax(logits[0, len(ids) - 1])))
    return ids[len(prompt):]


def _checked_against_teacher_forcing(model, params, out) -> int:
    """Every sampled token's logprob equals a teacher-forced pass over prompt + completion (<= 1e-4); returns how
    many were checked."""
    checked = 0
    for r in out:
        for c in r.completions:
            full = np.concatenate([r.prompt_tokens, c.tokens])
            lp = np.asarray(model.get_logprobs(params, jnp.asarray(full[None]), jnp.asarray([len(full)])))
            lp = lp[0, len(r.prompt_tokens) - 1:]
            np.testing.assert_allclose(c.logprobs[~c.forced], lp[~c.forced], atol=1e-4)
            checked += int((~c.forced).sum())
    return checked


@pytest.mark.parametrize("devices,mode", [(1, "threads"), (4, "spmd")])
def test_greedy_decode_equals_full_forward_greedy(moe_params, tok, devices, mode):
    """Continuous batching (6 prompts x 1 sample through a batch of 4), on one device and on a dp x tp replica whose
    experts' width splits over tp (each shard's partial sums psum'd in `moe_mlp`)."""
    model, params = moe_params
    cfg = dataclasses.replace(BASE, temperature=0.0, group_size=1, max_seq_len=32, replica_mode=mode,
                              tp=2 if devices > 1 else 1)
    out = ReplicaSet(model, params, cfg, tok, devices=jax.devices()[:devices]).generate(_requests(tok, 6, 1))
    assert len(out) == 6
    total = 0
    for r in out:
        c = r.completions[0]
        sampled = c.tokens[~c.forced]
        assert sampled.tolist() == _greedy_reference(model, params, r.prompt_tokens, len(sampled))
        total += len(sampled)
    assert total > 40


def test_sampled_logprobs_match_teacher_forced(moe_params, tok):
    model, params = moe_params
    out = ReplicaSet(model, params, BASE, tok, devices=jax.devices()[:1], seed=3).generate(_requests(tok))
    assert _checked_against_teacher_forcing(model, params, out) > 50


def _mixed_reference(model, weights, prompt, c):
    """Logprobs of c's tokens as an engine that changed weights mid-completion computed them: the prompt's cache by
    weights[c.prompt_version], and each step (its fed token's K/V and its logits) by the weights of its version."""
    apply = jax.jit(model.apply)
    cache = model.init_kv_cache(1, len(prompt) + len(c.tokens) + 1)
    _, cache = apply(weights[c.prompt_version], jnp.asarray([prompt[:-1]]), jnp.asarray([len(prompt) - 1]),
                           cache)
    fed, out = prompt[-1], []
    for tok_id, v in zip(c.tokens, c.versions):
        logits, cache = apply(weights[int(v)], jnp.asarray([[fed]]), jnp.asarray([1]), cache)
        out.append(float(jax.nn.log_softmax(logits[0, 0])[tok_id]))
        fed = int(tok_id)
    return np.asarray(out)


def test_a_weight_update_inside_a_completion_takes_effect(moe_params, tok):
    """New weights (every router and expert changed) land after a few decode loops: the tokens sampled after them
    carry the new version, and every logprob is what the weights of its version compute from that cache."""
    model, params = moe_params
    new = jax.tree.map(lambda w: w + 0.05 * jax.random.normal(jax.random.PRNGKey(1), w.shape), params)
    cfg = dataclasses.replace(BASE, group_size=2, max_decode_batch_size=4, decode_chunk_steps=3)
    eng = Engine(model, params, cfg, tok, seed=2)
    calls = {"n": 0}

    def hook():  # the first calls only fill the batch's free rows; then each runs up to 3 decode steps
        calls["n"] += 1
        if calls["n"] == 8:
            eng.set_params(new, 1)

    eng.between_loops = hook
    out = eng.generate(_requests(tok, 2, 2), drain=True)
    spans = [(r, c) for r in out for c in r.completions if c.versions.min() == 0 and c.versions.max() == 1]
    assert spans, "some completion must straddle the update"
    moved = 0.0
    for r, c in spans:
        lp = _mixed_reference(model, {0: params, 1: new}, list(r.prompt_tokens), c)
        np.testing.assert_allclose(c.logprobs[~c.forced], lp[~c.forced], atol=1e-4)
        old = _mixed_reference(model, {0: params, 1: params}, list(r.prompt_tokens), c)
        after = (c.versions == 1) & ~c.forced
        moved = max(moved, float(np.abs(old[after] - c.logprobs[after]).max()))
    assert moved > 1e-2, "the tokens after the update must be the new weights' (they equal the old ones')"


class _Echo:
    """Answers each of the first two turns with a fixed observation, then ends."""

    stop: tuple = ()

    def __init__(self, prompt, observations):
        self.prompt, self.observations = list(prompt), observations

    def reset(self):
        return list(self.prompt)

    def step(self, turn):
        if turn.index < len(self.observations) and not turn.last:
            return StepResult(self.observations[turn.index], 0.0, False)
        return StepResult(None, 1.0, True, "correct")


@pytest.mark.parametrize("feed", [16, 0])
def test_a_multi_turn_trajectory_is_what_the_sampler_saw(moe_params, tok, feed):
    """Observations go back in by decode steps (feed 16) or through the extend program (feed 0); either way every
    sampled token's logprob equals the teacher-forced one over the whole trajectory."""
    model, params = moe_params
    obs = [tok.encode("=4>"), tok.encode("ok 7>")]
    cfg = dataclasses.replace(BASE, max_seq_len=96, max_turns=3, max_new_tokens=10, decode_feed_tokens=feed)
    eng = Engine(model, params, cfg, tok, seed=1)
    out = eng.generate(_requests(tok, 3, 2, envs=lambda ids, k: [_Echo(ids, obs) for _ in range(k)]))
    for r in out:
        for c in r.completions:
            assert c.n_turns == 3 and c.observation_tokens == sum(len(o) for o in obs)
    assert _checked_against_teacher_forcing(model, params, out) > 50
    assert (eng.stats.fed_tokens > 0) == (feed > 0) and (eng.stats.extend_time > 0) == (feed == 0)
