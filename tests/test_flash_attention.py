"""The TPU training attention (Pallas flash kernel) against a plain masked softmax, on ragged right-padded rows,
values and gradients. On the CPU the kernel runs in Pallas' TPU interpret mode; on 4 fake devices it also runs
under the batch sharding of FSDP."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from asyncrl.models.flash import block_size, flash_attention_train

B, T, H, K, DH = 4, 256, 4, 2, 128
LENS = np.array([256, 131, 1, 200], np.int32)


def reference(q, k, v, lens):
    k, v = (jnp.repeat(x, H // K, axis=2) for x in (k, v))
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(DH)
    t, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    visible = (j <= t)[None] & (j[None] < lens[:, None, None])
    s = jnp.where(visible[:, None], s, -1e30)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v)


def inputs():
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(B, T, h, DH)), jnp.float32) for h in (H, K, K))
    cot = jnp.asarray(r.normal(size=(B, T, H, DH)), jnp.float32)
    valid = jnp.asarray(np.arange(T)[None, :] < LENS[:, None])
    return q, k, v, jnp.asarray(LENS), cot * valid[:, :, None, None]  # no cotangent on padding: nothing reads it


def loss(fn, q, k, v, lens, cot):
    return jnp.sum(fn(q, k, v, lens) * cot)


def test_block_size():
    assert block_size(4096) == 512 and block_size(4352) == 256 and block_size(384) == 128 and block_size(100) is None


@pytest.mark.parametrize("sharded", [False, True], ids=["one-device", "fsdp4"])
def test_flash_matches_reference_on_ragged_rows(sharded):
    q, k, v, lens, cot = inputs()
    want = reference(q, k, v, lens)
    want_g = jax.grad(lambda *a: loss(reference, *a, lens, cot), argnums=(0, 1, 2))(q, k, v)
    with pltpu.force_tpu_interpret_mode():
        if sharded:
            mesh = jax.make_mesh((4,), ("fsdp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
            with jax.set_mesh(mesh):
                put = lambda x: jax.device_put(x, NamedSharding(mesh, P("fsdp", *([None] * (x.ndim - 1)))))  # noqa: E731
                args = [put(x) for x in (q, k, v, lens, cot)]
                got = jax.jit(flash_attention_train)(*args[:4])
                got_g = jax.jit(jax.grad(lambda *a: loss(flash_attention_train, *a), argnums=(0, 1, 2)))(*args)
                assert got.sharding.spec[0] == "fsdp"
        else:
            got = jax.jit(flash_attention_train)(q, k, v, lens)
            got_g = jax.jit(jax.grad(lambda *a: loss(flash_attention_train, *a), argnums=(0, 1, 2)))(q, k, v, lens, cot)
    valid = np.arange(T)[None, :] < LENS[:, None]
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=2e-5, rtol=1e-5)
    for g, w in zip(got_g, want_g):
        np.testing.assert_allclose(np.asarray(g)[valid], np.asarray(w)[valid], atol=2e-5, rtol=1e-5)


def test_a_prefill_through_flash_writes_the_cache_the_reference_writes():
    """`inference.prefill_attention` (flash on TPU): a prefill attends over its own prompt tokens only, so the
    kernel's causal, length-masked attention must leave every real position's K/V, and the hidden state of each
    row's last real token, as the reference does. Ragged rows in one 256-token bucket."""
    import dataclasses

    from asyncrl.models import Model, kvcache, preset

    cfg = dataclasses.replace(preset("tiny"), head_dim=128)  # the kernel's lane width
    model = Model(cfg)
    params = model.init_params(jax.random.PRNGKey(0), jnp.float32)
    lens = jnp.asarray([256, 131, 7], jnp.int32)
    x = jnp.asarray(np.random.default_rng(1).integers(1, cfg.vocab_size, (3, 256)), jnp.int32)
    kv = kvcache.zeros(cfg, 3, 512, jnp.float32)
    want_h, want_kv = jax.jit(model.prefill)(params, x, lens, kv)
    assert not model.flash
    with pltpu.force_tpu_interpret_mode():
        got_h, got_kv = jax.jit(model.with_flash(True).prefill)(params, x, lens, kv)
    valid = np.arange(512)[None, :] < np.asarray(lens)[:, None]  # [B, S]
    for got, want in ((got_kv.k, want_kv.k), (got_kv.v, want_kv.v)):  # [L, B, K, S, Dh]
        g, w = np.moveaxis(np.asarray(got), 3, 2), np.moveaxis(np.asarray(want), 3, 2)  # [L, B, S, K, Dh]
        np.testing.assert_allclose(g[:, valid], w[:, valid], atol=2e-5, rtol=1e-5)
        assert np.abs(w[:, valid]).max() > 0.1  # something was written
    last = np.asarray(lens) - 1
    np.testing.assert_allclose(np.asarray(got_h)[np.arange(3), last], np.asarray(want_h)[np.arange(3), last],
                               atol=2e-5, rtol=1e-5)


def test_prefill_attention_is_flash_on_tpu_only_unless_forced():
    from asyncrl.inference.config import InferenceConfig
    from asyncrl.inference.layout import Layout
    from asyncrl.models import Model, preset
    from asyncrl.validate import ConfigError

    model = Model(preset("tiny"))
    assert not Layout(model, InferenceConfig(), None, pad_id=0).model.flash  # auto on the CPU: reference
    assert Layout(model, InferenceConfig(prefill_attention="flash"), None, pad_id=0).model.flash
    with pytest.raises(ConfigError, match="inference.prefill_attention"):
        InferenceConfig(prefill_attention="dense")
