"""Chunked fp32 logprobs with a custom VJP: values, gradients, sharding on 8 fake devices, compiled memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from asyncrl.ops.logprobs import (
    fused_linear_selection,
    fused_logprobs_and_entropy,
    scale_for_temperature,
)
from asyncrl.sharding.axes import TOKEN_AXES

N, D, V = 100, 32, 257  # N is not a multiple of any chunk size used below


def naive(h, W, targets):
    logits = h.astype(jnp.float32) @ W.astype(jnp.float32)  # [N, V]
    return jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, None], axis=-1)[:, 0]


def inputs(n=N, seed=0):
    kh, kw, kt, kc = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(kh, (n, D), jnp.float32)
    W = jax.random.normal(kw, (D, V), jnp.float32) * 0.3
    targets = jax.random.randint(kt, (n,), 0, V)
    cot = jax.random.normal(kc, (n,), jnp.float32)  # a generic cotangent, not just ones
    return h, W, targets, cot


def value_and_grads(f, h, W, targets, cot):
    return jax.value_and_grad(lambda h, W: jnp.sum(cot * f(h, W, targets)), argnums=(0, 1))(h, W)


@pytest.mark.parametrize("chunk_size", [1, 16, 33, 100, 4096])
def test_matches_naive_values_and_grads(chunk_size):
    h, W, targets, cot = inputs()
    fused = jax.jit(lambda h, W, t: fused_linear_selection(h, W, t, chunk_size))
    np.testing.assert_allclose(fused(h, W, targets), naive(h, W, targets), atol=1e-5, rtol=1e-5)
    got_value, (got_dh, got_dW) = jax.jit(lambda *a: value_and_grads(fused, *a))(h, W, targets, cot)
    want_value, (want_dh, want_dW) = value_and_grads(naive, h, W, targets, cot)
    np.testing.assert_allclose(got_value, want_value, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got_dh, want_dh, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got_dW, want_dW, atol=1e-5, rtol=1e-5)


def test_eager_and_bf16_inputs():
    h, W, targets, cot = inputs()
    np.testing.assert_allclose(fused_linear_selection(h, W, targets, 32), naive(h, W, targets), atol=1e-5, rtol=1e-5)
    hb, Wb = h.astype(jnp.bfloat16), W.astype(jnp.bfloat16)
    _, (dh, dW) = value_and_grads(lambda *a: fused_linear_selection(*a, chunk_size=32), hb, Wb, targets, cot)
    _, (want_dh, want_dW) = value_and_grads(naive, hb, Wb, targets, cot)
    assert dh.dtype == jnp.bfloat16 and dW.dtype == jnp.bfloat16
    # The kernel works in fp32 and rounds once at the end, like the naive version.
    np.testing.assert_allclose(dh.astype(jnp.float32), want_dh.astype(jnp.float32), atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(dW.astype(jnp.float32), want_dW.astype(jnp.float32), atol=1e-2, rtol=1e-2)


def test_entropy_matches_naive_and_carries_no_gradient():
    h, W, targets, cot = inputs()
    logprobs, entropy = jax.jit(lambda *a: fused_logprobs_and_entropy(*a, chunk_size=16))(h, W, targets)
    p = jax.nn.softmax(h @ W)
    np.testing.assert_allclose(logprobs, naive(h, W, targets), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(entropy, -jnp.sum(p * jnp.log(p), axis=-1), atol=1e-5, rtol=1e-5)
    dh, dW = jax.grad(lambda h, W: jnp.sum(fused_logprobs_and_entropy(h, W, targets, 16)[1]), argnums=(0, 1))(h, W)
    assert not np.any(dh) and not np.any(dW)
    both = lambda h, W, t: fused_logprobs_and_entropy(h, W, t, 16)[0]  # noqa: E731
    _, (dh, _) = value_and_grads(both, h, W, targets, cot)
    _, (want_dh, _) = value_and_grads(naive, h, W, targets, cot)
    np.testing.assert_allclose(dh, want_dh, atol=1e-5, rtol=1e-5)


def test_temperature_scaling():
    h, W, targets, _ = inputs()
    want = jnp.take_along_axis(jax.nn.log_softmax(h @ W / 0.7), targets[:, None], axis=-1)[:, 0]
    got = fused_linear_selection(scale_for_temperature(h, 0.7), W, targets, 32)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert scale_for_temperature(h, 0.0) is h  # greedy: scored under temperature 1
    dh = jax.grad(lambda t: jnp.sum(scale_for_temperature(h, t)))(jnp.float32(0.0))
    assert np.isfinite(dh)
    np.testing.assert_allclose(scale_for_temperature(h, jnp.float32(0.0)), h)


def test_rejects_bad_arguments():
    h, W, targets, _ = inputs()
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_selection(h, W, targets, 0)
    with pytest.raises(ValueError, match="shape"):
        fused_linear_selection(h[:-1], W, targets)


def data_mesh(axis_type):
    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices; tests/conftest.py sets XLA_FLAGS for that")
    return jax.make_mesh((2, 4) + (1,) * (len(TOKEN_AXES) - 2), TOKEN_AXES, axis_types=(axis_type,) * len(TOKEN_AXES))


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("n", [96, 100], ids=["even", "uneven"])
def test_sharded_matches_single_device(axis_type, n):
    h, W, targets, cot = inputs(n, seed=1)
    want_value, (want_dh, want_dW) = value_and_grads(naive, h, W, targets, cot)
    want_lp = naive(h, W, targets)
    mesh = data_mesh(axis_type)
    # An uneven token count cannot be split over 8 devices; it arrives replicated.
    token_spec = P(TOKEN_AXES) if n % 8 == 0 else P(None)
    with jax.set_mesh(mesh):
        hs = jax.device_put(h, NamedSharding(mesh, P(*token_spec, None)))
        ts = jax.device_put(targets, NamedSharding(mesh, token_spec))
        cs = jax.device_put(cot, NamedSharding(mesh, token_spec))
        Ws = jax.device_put(W, NamedSharding(mesh, P("fsdp", None)))  # FSDP-sharded LM head
        fused = lambda h, W, t: fused_linear_selection(h, W, t, 24)  # noqa: E731
        lp = jax.jit(fused)(hs, Ws, ts)
        value, (dh, dW) = jax.jit(lambda *a: value_and_grads(fused, *a))(hs, Ws, ts, cs)
        if axis_type == AxisType.Explicit:
            assert dh.sharding.spec == hs.sharding.spec and dW.sharding.spec == Ws.sharding.spec
    np.testing.assert_allclose(lp, want_lp, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(value, want_value, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(dh, want_dh, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(dW, want_dW, atol=1e-5, rtol=1e-5)


def test_sharded_chunking_needs_no_all_to_all():
    """Chunks are cut from each device's own rows, so the only collectives are the W gather and one dW sum."""
    mesh = data_mesh(AxisType.Explicit)
    spec = lambda *s: NamedSharding(mesh, P(*s))  # noqa: E731
    with jax.set_mesh(mesh):
        args = (
            jax.ShapeDtypeStruct((512, D), jnp.float32, sharding=spec(TOKEN_AXES, None)),
            jax.ShapeDtypeStruct((D, V - 1), jnp.float32, sharding=spec("fsdp", None)),
            jax.ShapeDtypeStruct((512,), jnp.int32, sharding=spec(TOKEN_AXES)),
        )
        f = jax.value_and_grad(lambda h, W, t: jnp.sum(fused_linear_selection(h, W, t, 64)), argnums=(0, 1))
        hlo = jax.jit(f).lower(*args).compile().as_text()
    assert "all-to-all" not in hlo
    assert hlo.count(" all-reduce(") + hlo.count(" all-reduce-start(") <= 1


def compiled_temp_bytes(f, *args):
    return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_memory_is_a_tenth_of_naive():
    """Acceptance: Qwen-sized LM head, 16k tokens. Compiles only; nothing is allocated or run."""
    n, d, v = 16384, 1024, 151936
    args = (
        jax.ShapeDtypeStruct((n, d), jnp.float32),
        jax.ShapeDtypeStruct((d, v), jnp.float32),
        jax.ShapeDtypeStruct((n,), jnp.int32),
    )

    def train(f):
        return jax.value_and_grad(lambda h, W, t: jnp.sum(f(h, W, t)), argnums=(0, 1))

    fused = compiled_temp_bytes(train(lambda h, W, t: fused_linear_selection(h, W, t, 1024)), *args)
    reference = compiled_temp_bytes(train(naive), *args)
    assert fused * 10 <= reference, (fused, reference)
