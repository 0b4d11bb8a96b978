"""The engine's CPU weight layout (`models/dense.py`): output-major weights give the same products as the model's
einsums, alone, under a dp x tp mesh (a contracted tensor-parallel dim is summed), and through a whole decode."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from asyncrl.models import dense, params as params_lib, preset
from asyncrl.models.transformer import Model


@pytest.mark.parametrize("eq,x_shape,w_shape,n_in", [
    ("btd,dn->btn", (3, 2, 8), (8, 12), 1),
    ("btd,dhk->bthk", (3, 1, 8), (8, 4, 6), 1),
    ("bthk,hkd->btd", (3, 2, 4, 6), (4, 6, 8), 2),
    ("...d,dv->...v", (5, 8), (8, 33), 1),
])
def test_dense_equals_the_einsum(eq, x_shape, w_shape, n_in):
    kx, kw = jax.random.split(jax.random.key(0))
    x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
    om = dense.output_major(w, n_in)
    assert om.t.shape == (*w_shape[n_in:], *w_shape[:n_in])
    np.testing.assert_allclose(jax.jit(dense.dense)(x, om), jnp.einsum(eq, x, w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dense.einsum(eq, x, om), dense.einsum(eq, x, w), rtol=1e-5, atol=1e-5)


def test_dense_under_a_dp_tp_mesh_keeps_the_layouts_and_sums_a_split_contraction():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    kx, kq, ko = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (4, 1, 8))
    wq, wo = jax.random.normal(kq, (8, 4, 6)), jax.random.normal(ko, (4, 6, 8))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("dp", None, None)))
        q = dense.output_major(jax.device_put(wq, NamedSharding(mesh, P(None, "tp", None))), 1)
        o = dense.output_major(jax.device_put(wo, NamedSharding(mesh, P("tp", None, None))), 2)
        yq = jax.jit(dense.dense)(xs, q)  # heads split over tp stay split
        yo = jax.jit(dense.dense)(jax.reshard(yq, P("dp", None, "tp", None)), o)  # the split heads are summed
    assert jax.typeof(yq).sharding.spec == P("dp", None, "tp", None)
    assert jax.typeof(yo).sharding.spec == P("dp", None, None)
    ref_q = jnp.einsum("btd,dhk->bthk", x, wq)
    np.testing.assert_allclose(yq, ref_q, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(yo, jnp.einsum("bthk,hkd->btd", ref_q, wo), rtol=1e-5, atol=1e-4)


def test_cpu_decode_layout_forward_equals_the_stacked_forward():
    """Per-layer output-major weights (tied and untied heads) give the stacked tree's logits and cache."""
    for tied in (True, False):
        cfg = dataclasses.replace(preset("tiny"), tie_word_embeddings=tied)
        model = Model(cfg)
        params = model.init_params(jax.random.key(2))
        layout = dense.cpu_decode_layout(params)
        assert dense.is_output_major(layout) and not dense.is_output_major(params_lib.unstack_layers(params))
        assert (layout.lm_head is None) == tied
        x = jax.random.randint(jax.random.key(3), (3, 5), 0, cfg.vocab_size)
        lens = jnp.array([5, 3, 1], jnp.int32)
        ref, _ = jax.jit(model.apply)(params, x, lens)
        got, _ = jax.jit(model.apply)(layout, x, lens)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
