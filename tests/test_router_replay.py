"""Router replay through the model (`Model.apply_routed`, `Model.get_logprobs(expert_ids=...)`): a sampler that
decodes token by token with a KV cache records each fed token's experts at every MoE layer; a trainer's full forward
replays them at the model tokens (prompt tokens, given -1, take the router's own choice)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.models import Model, preset

MODEL = Model(preset("tiny_moe"))
CFG = MODEL.cfg
LM, K = len(CFG.sparse_layers), CFG.num_experts_per_tok


@pytest.fixture(scope="module")
def params():
    return MODEL.init_params(jax.random.PRNGKey(0))


def _sample(params, prompt, n, key, forced_routes=None):
    """Decode n tokens with a KV cache, as the engine does: prefill all but the last prompt token, then feed one
    token a step. Returns (tokens [n], logprobs [n], the routing record [P + n, Lm, k] int8 with -1 at prompt
    positions). `forced_routes` [n, Lm, k]: route step j's fed token (a model token, j >= 1) there instead of by
    its top-k: a sampler whose choice differs from the trainer's router, as bf16 near-ties or another kernel do."""
    P = len(prompt)
    cache = MODEL.init_kv_cache(1, P + n + 1)
    _, cache = MODEL.prefill(params, jnp.asarray([prompt[:-1]]), jnp.asarray([P - 1]), cache)
    record = np.full((P + n, LM, K), -1, np.int8)
    toks, lps, fed = [], [], prompt[-1]
    for j in range(n):
        given = None if forced_routes is None or j == 0 else jnp.asarray(forced_routes[j])[None, None]
        logits, cache, ids = MODEL.apply_routed(params, jnp.asarray([[fed]]), jnp.asarray([1]), cache,
                                                expert_ids=given)
        if j >= 1:  # the fed token is the model's token j-1; the last prompt token keeps -1
            record[P - 1 + j] = np.asarray(ids[0, 0])
        lp = jax.nn.log_softmax(logits[0, 0])
        tok = int(jax.random.categorical(jax.random.fold_in(key, j), lp))
        toks.append(tok)
        lps.append(float(lp[tok]))
        fed = tok
    return np.asarray(toks), np.asarray(lps), record


def _score(params, prompt, toks, record=None):
    """The trainer's teacher-forced logprobs of toks, and the routing it used [P + n, Lm, k]."""
    full = jnp.asarray([list(prompt) + list(toks)])
    n = jnp.asarray([full.shape[1]])
    ids_in = None if record is None else jnp.asarray(record)[None]
    lp = MODEL.get_logprobs(params, full, n, expert_ids=ids_in)
    _, _, used = MODEL.apply_routed(params, full, n, expert_ids=ids_in)
    return np.asarray(lp)[0, len(prompt) - 1:], np.asarray(used)[0]


def _random_routes(n, seed):
    """n x Lm random choices of k distinct experts."""
    rng = np.random.default_rng(seed)
    return np.stack([[rng.permutation(CFG.num_experts)[:K] for _ in range(LM)] for _ in range(n)]).astype(np.int8)


def _differ(a, b):
    """Share of (token, layer) pairs whose expert sets differ."""
    return float(np.mean(np.any(np.sort(a, -1) != np.sort(b, -1), -1)))


PROMPT = [5, 17, 3, 44, 9, 12]


def test_the_record_is_compact_and_holds_every_model_token(params):
    toks, _, record = _sample(params, PROMPT, 12, jax.random.PRNGKey(1))
    assert record.dtype == np.int8 and record.nbytes == (len(PROMPT) + 12) * LM * K  # Lm * k bytes a token
    assert (record[:len(PROMPT)] == -1).all()  # prompt tokens: the router's own choice
    assert (record[len(PROMPT):-1] >= 0).all()  # every fed model token is recorded (the last is never fed)


def test_replay_makes_a_perturbed_routers_routing_the_samplers_at_every_model_token(params):
    """(a) The trainer's router moved (a later policy): on its own it routes differently; replayed, its routing is
    the sampler's at every model token, and the router still gets a gradient."""
    toks, _, record = _sample(params, PROMPT, 16, jax.random.PRNGKey(2))
    moved = jax.tree.map(lambda w: w, params)
    moe = moved.layers.moe
    moved.layers.moe = type(moe)(moe.router + 0.3 * jax.random.normal(jax.random.PRNGKey(3), moe.router.shape),
                                 moe.w_gate, moe.w_up, moe.w_down)
    model_tok = slice(len(PROMPT), len(PROMPT) + len(toks) - 1)
    _, own = _score(moved, PROMPT, toks)
    _, replayed = _score(moved, PROMPT, toks, record)
    assert _differ(own[model_tok], record[model_tok]) > 0.1
    np.testing.assert_array_equal(replayed[model_tok], record[model_tok])
    _, same = _score(params, PROMPT, toks)  # unmoved, the trainer's own routing is the sampler's already
    np.testing.assert_array_equal(same[model_tok], record[model_tok])

    def loss(router):
        p = jax.tree.map(lambda w: w, moved)
        p.layers.moe = type(moe)(router, moe.w_gate, moe.w_up, moe.w_down)
        full = jnp.asarray([PROMPT + list(toks)])
        return jnp.sum(MODEL.get_logprobs(p, full, jnp.asarray([full.shape[1]]),
                                          expert_ids=jnp.asarray(record)[None]))

    assert float(jnp.abs(jax.grad(loss)(moved.layers.moe.router)).max()) > 0


def test_replayed_logprobs_equal_the_samplers_where_routing_differs(params):
    """(b) A sampler whose routing is not the router's top-k: teacher forcing with the record reproduces its
    logprobs (fp32, <= 1e-4); without the record the trainer routes by its top-k and scores another function."""
    n = 16
    forced = _random_routes(n, seed=4)
    toks, lps, record = _sample(params, PROMPT, n, jax.random.PRNGKey(5), forced_routes=forced)
    model_tok = slice(len(PROMPT), len(PROMPT) + n - 1)
    replay_lp, used = _score(params, PROMPT, toks, record)
    np.testing.assert_array_equal(used[model_tok], record[model_tok])
    np.testing.assert_allclose(replay_lp, lps, atol=1e-4)
    own_lp, own = _score(params, PROMPT, toks)
    assert _differ(own[model_tok], record[model_tok]) > 0.3
    assert float(np.abs(own_lp - lps).max()) > 1e-2
