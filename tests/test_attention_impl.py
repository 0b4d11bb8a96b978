"""The attention a GPU would run (models/attention_impl.py), checked on the CPU where it can run.

cuDNN cannot run here: for it, the dispatch is checked (cuDNN for a GPU with eligible dtype and shapes, the
reference otherwise, and never off GPU). `jax.nn.dot_product_attention(implementation="xla")`, called exactly as
the cuDNN path calls it, runs here and is compared with the reference at 1e-5 in fp32: GQA, causal masks over
right padding, under FSDP batch sharding, values and gradients, and through the whole model's logits. The decode
case (one query over cached keys) checks the path a GPU decodes with, the blocked `cached_attention`."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from asyncrl.models import Model, preset
from asyncrl.models.attention import attention, cached_attention
from asyncrl.models.attention_impl import choose, platform, self_attention

B, T, H, K, DH = 4, 24, 8, 2, 16
LENS = np.array([24, 13, 1, 20], np.int32)


def _qkv(seed=0, t=T, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    return [jnp.asarray(r.normal(size=(B, t, h, DH)), dtype) for h in (H, K, K)]


def _pos(t=T):
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (B, t))


@pytest.mark.parametrize("dtype, dh, heads, want", [
    (jnp.bfloat16, 128, (32, 8), "cudnn"),   # Qwen3-8B: bf16, Dh 128, GQA 4
    (jnp.float16, 64, (16, 16), "cudnn"),    # fp16, MHA
    (jnp.float32, 128, (32, 8), "reference"),  # fp32: cuDNN flash takes bf16/fp16 only
    (jnp.bfloat16, 256, (8, 8), "reference"),  # head dim above the bound we can check without the device
    (jnp.bfloat16, 100, (8, 8), "reference"),  # not a multiple of 8
])
def test_dispatch_on_a_gpu(dtype, dh, heads, want):
    h, k = heads
    c = choose("gpu", dtype, (2, 128, h, dh), (2, 128, k, dh))
    assert c.impl == want and c.reason.startswith("gpu")


@pytest.mark.parametrize("plat", ["cpu", "tpu"])
def test_dispatch_off_gpu_is_the_reference(plat):
    c = choose(plat, jnp.bfloat16, (2, 128, 32, 128), (2, 128, 8, 128))
    assert c.impl == "reference" and plat in c.reason


def test_platform_of_a_trace():
    assert platform() == "cpu"
    mesh = jax.make_mesh((2,), ("fsdp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        assert platform() == "cpu"  # read off the mesh's devices


@pytest.mark.parametrize("sharded", [False, True], ids=["one-device", "fsdp2"])
def test_xla_library_path_matches_the_reference(sharded):
    """GQA 8/2 over ragged right padding; padding queries included (both see every real key up to themselves)."""
    q, k, v = _qkv()
    lens = jnp.asarray(LENS)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, H, DH)), jnp.float32)
    loss = lambda impl: lambda q, k, v: jnp.sum(self_attention(q, k, v, _pos(), lens, False, impl) * cot)  # noqa: E731
    want = attention(q, k, v, _pos(), lens)
    want_g = jax.grad(loss("reference"), argnums=(0, 1, 2))(q, k, v)
    if sharded:
        mesh = jax.make_mesh((2,), ("fsdp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
        with jax.set_mesh(mesh):
            put = lambda x: jax.device_put(x, NamedSharding(mesh, P("fsdp", *([None] * (x.ndim - 1)))))  # noqa: E731
            q, k, v, lens, cot = (put(x) for x in (q, k, v, lens, cot))
            got = jax.jit(lambda q, k, v, n: self_attention(q, k, v, _pos(), n, False, "xla"))(q, k, v, lens)
            got_g = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2)))(q, k, v)
            assert got.sharding.spec[0] == "fsdp"
    else:
        got = jax.jit(lambda q, k, v: self_attention(q, k, v, _pos(), lens, False, "xla"))(q, k, v)
        got_g = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    for g, w in zip(got_g, want_g):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=0)


def test_decode_one_query_over_cached_keys():
    """One new token per row at position start[b] over the cached prefix: the blocked read a GPU decodes with,
    and the library call given the keys' lengths, against the reference over the whole written sequence."""
    S, block = 40, 16
    r = np.random.default_rng(2)
    start = jnp.asarray([39, 5, 0, 17], jnp.int32)
    k_all, v_all = (jnp.asarray(r.normal(size=(B, S, K, DH)), jnp.float32) for _ in range(2))
    q = jnp.asarray(r.normal(size=(B, 1, H, DH)), jnp.float32)
    rows = jnp.arange(B)
    k_new, v_new = k_all[rows, start][:, None], v_all[rows, start][:, None]  # [B, 1, K, Dh]: the step's own key
    cache_k, cache_v = (jnp.swapaxes(x, 1, 2)[None] for x in (k_all, v_all))  # [1, B, K, S, Dh]
    want = attention(q, k_all, v_all, start[:, None], start + 1)
    got = cached_attention(q, k_new, v_new, cache_k, cache_v, 0, start, jnp.ones((B,), jnp.int32), block)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    lib = jax.nn.dot_product_attention(q, k_all, v_all, key_value_seq_lengths=start + 1, implementation="xla")
    np.testing.assert_allclose(np.asarray(lib), np.asarray(want), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def tiny():
    model = Model(preset("tiny"))
    return model, model.init_params(jax.random.PRNGKey(0))


def test_model_logits_with_each_implementation(tiny):
    model, params = tiny
    x = jnp.asarray(np.random.default_rng(3).integers(0, model.cfg.vocab_size, (B, T)), jnp.int32)
    lens = jnp.asarray(LENS)
    valid = np.arange(T)[None, :] < LENS[:, None]
    ref = dataclasses.replace(model, attention_impl="reference")
    want, _ = jax.jit(ref.apply)(params, x, lens)
    for impl in ("auto", "xla"):
        got, _ = jax.jit(dataclasses.replace(model, attention_impl=impl).apply)(params, x, lens)
        np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=1e-5, rtol=0, err_msg=impl)
    # A prefill into a cache, then one decode step: the same logits whichever path the prefill took.
    kv = model.init_kv_cache(B, 32)
    outs = []
    for impl in ("reference", "xla"):
        m = dataclasses.replace(model, attention_impl=impl)
        _, cache = jax.jit(m.prefill)(params, x, lens, kv)
        step, _ = jax.jit(m.apply)(params, x[:, :1], jnp.ones((B,), jnp.int32), cache)
        outs.append(np.asarray(step))
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-5, rtol=0)


def test_auto_on_the_cpu_is_bit_identical_to_the_reference(tiny):
    """Off GPU 'auto' is the reference itself: the dense model stays bit-identical, bf16 included."""
    model, params = tiny
    params = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
    x = jnp.asarray(np.random.default_rng(4).integers(0, model.cfg.vocab_size, (B, T)), jnp.int32)
    a, _ = jax.jit(model.apply)(params, x, jnp.asarray(LENS))
    b, _ = jax.jit(dataclasses.replace(model, attention_impl="reference").apply)(params, x, jnp.asarray(LENS))
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_an_unknown_implementation_is_refused():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="Model.attention_impl='bad'"):
        self_attention(q, k, v, _pos(), jnp.asarray(LENS), False, "bad")
