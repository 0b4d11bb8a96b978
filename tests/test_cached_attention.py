"""Blocked cached attention against the dense reference; the [L, B, K, S, Dh] cache through prefill and decode;
the vocab-split embedding lookup; and a bounded decode loop on a sharded mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from asyncrl.models import Model, params as params_lib, preset
from asyncrl.models.attention import attention, cached_attention
from asyncrl.sharding.rules import tensor_parallel_rules


def _reference(q, k_new, v_new, cache_k, cache_v, layer, start, seq_lens):
    """Write the new keys into a copy of the cache, then dense attention over all of it."""
    ck, cv = np.array(cache_k[layer]), np.array(cache_v[layer])  # [B, K, S, Dh]
    for b in range(q.shape[0]):
        n = q.shape[1]
        ck[b, :, start[b]:start[b] + n] = np.swapaxes(k_new[b], 0, 1)
        cv[b, :, start[b]:start[b] + n] = np.swapaxes(v_new[b], 0, 1)
    q_pos = start[:, None] + np.arange(q.shape[1])[None, :]
    return attention(q, jnp.swapaxes(ck, 1, 2), jnp.swapaxes(cv, 1, 2), q_pos, start + seq_lens)


@pytest.mark.parametrize("T,block", [(1, 4), (1, 5), (3, 8), (1, 64), (4, 7)])
def test_blocked_matches_dense_on_ragged_rows(T, block):
    rng = np.random.default_rng(T * 100 + block)
    L, B, K, G, S, Dh = 2, 5, 2, 3, 29, 8
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    q, k_new, v_new = f(B, T, K * G, Dh), f(B, T, K, Dh), f(B, T, K, Dh)
    cache_k, cache_v = f(L, B, K, S, Dh), f(L, B, K, S, Dh)  # garbage past each row's prefix must not leak in
    start = np.array([0, 3, 17, S - T, 9], np.int32)  # an empty row, ragged rows, one filling the cache
    seq_lens = np.array([T, 1, 0, T, max(T - 1, 0)], np.int32)  # right-padded calls; a dead row (0 tokens)
    fn = jax.jit(cached_attention, static_argnames="block")
    for layer in range(L):
        ours = fn(q, k_new, v_new, cache_k, cache_v, jnp.int32(layer), start, seq_lens, block=block)
        ref = _reference(q, k_new, v_new, cache_k, cache_v, layer, start, seq_lens)
        for b in range(B):
            n = seq_lens[b]  # queries past a row's tokens are padding
            np.testing.assert_allclose(np.asarray(ours)[b, :n], np.asarray(ref)[b, :n], atol=1e-5)
        assert np.isfinite(np.asarray(ours)).all()


def test_block_loop_stops_at_the_longest_row():
    """Cache positions past every row's prefix are never read: NaNs there leave the output finite and equal."""
    rng = np.random.default_rng(0)
    B, K, S, Dh = 3, 1, 40, 4
    q, k_new, v_new = (rng.standard_normal((B, 1, 2, Dh)).astype(np.float32),
                       *rng.standard_normal((2, B, 1, K, Dh)).astype(np.float32))
    cache = rng.standard_normal((1, B, K, S, Dh)).astype(np.float32)
    start = np.array([5, 11, 2], np.int32)
    poisoned = cache.copy()
    poisoned[:, :, :, 16:] = np.nan  # blocks of 8: positions 0..15 cover the longest prefix (11)
    args = (jnp.int32(0), start, np.ones(B, np.int32))
    a = cached_attention(q, k_new, v_new, cache, cache, *args, block=8)
    b = cached_attention(q, k_new, v_new, poisoned, poisoned, *args, block=8)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("block,unstacked", [(3, False), (8, False), (3, True)])
def test_prefill_then_decode_steps_equal_full_forward(block, unstacked):
    """unstacked: prefill and decode take per-layer weights and a per-layer cache (the engine's CPU layout, a
    Python loop over layers); the full forward and the reference cache they are checked against are stacked."""
    model = dataclasses.replace(Model(preset("tiny")), kv_block=block)
    stacked = model.init_params(jax.random.PRNGKey(1))
    params = params_lib.unstack_layers(stacked) if unstacked else stacked
    assert isinstance(params.layers, tuple) == unstacked
    rng = np.random.default_rng(0)
    prompt = np.array([9, 2, 12, 5], np.int32)
    n_dec = 7
    full_lens = prompt + n_dec
    toks = rng.integers(1, model.cfg.vocab_size, size=(4, int(full_lens.max()))).astype(np.int32)
    full, _ = jax.jit(model.apply)(stacked, toks, full_lens)
    cache = model.init_kv_cache(4, 24, per_layer=unstacked)
    shape = (model.cfg.num_layers, 4, model.cfg.num_kv_heads, 24, model.cfg.head_dim)
    if unstacked:
        assert len(cache.k) == model.cfg.num_layers and all(leaf.shape == (1, *shape[1:]) for leaf in cache.k)
    else:
        assert cache.k.shape == shape
    width = 16
    ptoks = np.where(np.arange(width)[None] < prompt[:, None], toks[:, :width], 0)
    prefill = jax.jit(model.prefill, static_argnames="apply_lm_head")
    logits, cache = prefill(params, ptoks, prompt, cache, apply_lm_head=True)
    for b, n in enumerate(prompt):
        np.testing.assert_allclose(np.asarray(logits)[b, :n], np.asarray(full)[b, :n], atol=1e-4)
    step = jax.jit(model.apply)
    rows = np.arange(4)
    for t in range(n_dec):
        logits, cache = step(params, toks[rows, prompt + t][:, None], np.ones(4, np.int32), cache)
        np.testing.assert_allclose(np.asarray(logits)[:, 0], np.asarray(full)[rows, prompt + t], atol=1e-4)
    # The cache holds exactly what a fresh prefill of the whole sequences writes.
    ref = model.init_kv_cache(4, 24)
    _, ref = jax.jit(model.prefill)(stacked, toks, full_lens, ref)
    got_k, got_v = (np.concatenate(c) if unstacked else np.asarray(c) for c in (cache.k, cache.v))
    for b, n in enumerate(full_lens):
        np.testing.assert_allclose(got_k[:, b, :, :n], np.asarray(ref.k)[:, b, :, :n], atol=1e-5)
        np.testing.assert_allclose(got_v[:, b, :, :n], np.asarray(ref.v)[:, b, :, :n], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.length), full_lens)


def test_unstacked_layers_give_the_stacked_forward_and_gradients():
    """The cache-free forward over per-layer weights equals the layer scan, values and gradients."""
    model = Model(preset("tiny"))
    stacked = model.init_params(jax.random.PRNGKey(2))
    toks = np.random.default_rng(1).integers(1, model.cfg.vocab_size, size=(3, 11)).astype(np.int32)
    lens = np.array([11, 6, 1], np.int32)
    loss = lambda p: jnp.sum(model.get_logprobs(p, toks, lens))  # noqa: E731
    a, ga = jax.jit(jax.value_and_grad(loss))(stacked)
    b, gb = jax.jit(jax.value_and_grad(loss))(params_lib.unstack_layers(stacked))
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
    ga = params_lib.unstack_layers(ga)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_sharded_decode_step_equals_unsharded_and_gathers_no_table():
    """tp=2, dp=2: the vocab-split embedding lookup and the blocked cache read give the unsharded logits, and
    the compiled step all-gathers no [V, D] table."""
    base = dataclasses.replace(Model(preset("tiny")), kv_block=4)
    params = base.init_params(jax.random.PRNGKey(2))
    B, S = 4, 16
    rng = np.random.default_rng(1)
    prompt = np.array([5, 9, 3, 7], np.int32)
    toks = rng.integers(1, base.cfg.vocab_size, size=(B, 16)).astype(np.int32)
    cache = base.init_kv_cache(B, S)
    _, cache = base.prefill(params, toks, prompt, cache)
    nxt = toks[np.arange(B), prompt][:, None]
    ref, _ = base.apply(params, nxt, np.ones(B, np.int32), cache)

    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    model = base.with_rules(tensor_parallel_rules("tp", data_axis="dp"))
    p_sh = jax.device_put(params, model.param_shardings(mesh))
    c_sh = jax.device_put(cache, model.kv_cache_sharding(mesh, B, S))
    assert c_sh.k.sharding.spec[1] == "dp"
    rep = NamedSharding(mesh, P())
    step = jax.jit(model.apply)
    with jax.set_mesh(mesh):
        args = (p_sh, jax.device_put(nxt, rep), jax.device_put(np.ones(B, np.int32), rep), c_sh)
        ours, new = step(*args)
        hlo = step.lower(*args).compile().as_text()
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), atol=1e-5)
    V, D = base.cfg.vocab_size, base.cfg.hidden_size
    gathers = [line for line in hlo.splitlines() if "all-gather" in line and f"[{V},{D}]" in line]
    assert not gathers, gathers[:2]
