"""The inference engine on a mixture-of-experts model (tiny_moe: 4 experts, top-2, layer 0 dense): prefill and decode
with continuous batching, multi-turn continuations, and in-flight weight updates, against full-forward references."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.inference.config import InferenceConfig
from asyncrl.inference.engine import Request
from asyncrl.inference.replicas import ReplicaSet
from asyncrl.models import Model, preset
from asyncrl.rollout import Prompt

BASE = InferenceConfig(group_size=2, max_decode_batch_size=4, max_prefill_prompts=4, max_seq_len=48,
                       temperature=1.0, params_dtype="float32", kv_cache_dtype="float32", min_prefill_bucket=8)
TEXTS = ["3 1 4 1 5>", "9 2 6>", "5 3 5 8 9 7 9>", "3 2>", "8 4 6 2 6 4 3 3>", "8 3 2 7 9>"]


@pytest.fixture(scope="module")
def moe_params():
    model = Model(preset("tiny_moe"))
    return model, model.init_params(jax.random.PRNGKey(0))


def _requests(tok, n=6, k=2):
    return [Request(Prompt(i, t, k), tok.encode(t)) for i, t in enumerate(TEXTS[:n])]


def _greedy_reference(model, params, prompt, n):
    """n greedy tokens, each from a full forward pass over everything so far (no cache)."""
    ids = list(prompt)
    for _ in range(n):
        logits, _ = model.apply(params, jnp.asarray([ids]), jnp.asarray([len(ids)]))
        ids.append(int(jnp.argmax(logits[0, -1])))
    return ids[len(prompt):]


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
    checked = 0
    for r in out:
        for c in r.completions:
            full = np.concatenate([r.prompt_tokens, c.tokens])
            lp = np.asarray(model.get_logprobs(params, jnp.asarray(full[None]), jnp.asarray([len(full)])))
            lp = lp[0, len(r.prompt_tokens) - 1:]
            np.testing.assert_allclose(c.logprobs[~c.forced], lp[~c.forced], atol=1e-4)
            checked += int((~c.forced).sum())
    assert checked > 50
