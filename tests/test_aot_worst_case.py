"""The cost model weights a data-dependent loop by the worst case its scope states; the cached decode step
compiles once whatever the rows' lengths (its block loop's trip count is a traced value, not a shape)."""

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.aot.hlo_cost import analyze_hlo
from asyncrl.models import Model, preset
from asyncrl.models.attention import WORST_CASE_SCOPE


def _blocks(x: jax.Array, n: jax.Array) -> jax.Array:
    def body(i, acc):
        return acc + jax.lax.dynamic_slice_in_dim(x, i * 128, 128, axis=0).sum(axis=0)

    with jax.named_scope(WORST_CASE_SCOPE.format(6)):
        return jax.lax.fori_loop(0, n, body, jnp.zeros(x.shape[1:], x.dtype))


def test_data_dependent_loop_counts_its_stated_worst_case():
    x = jax.ShapeDtypeStruct((768, 256), jnp.float32)
    text = jax.jit(_blocks).lower(x, jax.ShapeDtypeStruct((), jnp.int32)).compile().as_text()
    cost = analyze_hlo(text)
    assert [lp.trip_count for lp in cost.loops] == [6]
    assert cost.assumed_trip_counts and not cost.unknown_trip_counts
    # Six blocks of 128 x 256 f32 are read: the whole array, once.
    assert cost.hbm_bytes >= 768 * 256 * 4

    # Without the scope the same loop is unknown and weighted once.
    plain = jax.jit(lambda x, n: jax.lax.fori_loop(0, n, lambda i, a: a + x[i], jnp.zeros(x.shape[1:])))
    cost = analyze_hlo(plain.lower(x, jax.ShapeDtypeStruct((), jnp.int32)).compile().as_text())
    assert cost.unknown_trip_counts and not cost.assumed_trip_counts


def test_cached_decode_compiles_once_for_any_lengths():
    model = Model(preset("tiny"), kv_block=4)
    params = model.init_params(jax.random.PRNGKey(0))
    step = jax.jit(model.apply)
    cache = model.init_kv_cache(3, 32)
    x, ones = jnp.ones((3, 1), jnp.int32), jnp.ones((3,), jnp.int32)
    for lengths in ([0, 0, 0], [3, 9, 1], [31, 2, 17], [12, 12, 12]):
        cache.length = jnp.asarray(lengths, jnp.int32)
        logits, _ = step(params, x, ones, cache)
        assert np.isfinite(np.asarray(logits)).all()
    assert step._cache_size() == 1
