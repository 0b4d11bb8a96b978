"""Loading straight onto an FSDP sharding over 8 fake CPU devices gives the single-device logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from asyncrl.models import from_pretrained
from asyncrl.sharding.rules import fsdp_rules, tensor_parallel_rules
from tests.helpers import ragged_batch, save_hf_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = str(tmp_path_factory.mktemp("qwen"))
    save_hf_model("qwen3_untied", f)
    return f


def test_fsdp_load_on_8_devices(folder):
    assert jax.device_count() == 8
    model1, params1 = from_pretrained(folder)
    mesh = jax.make_mesh((1, 8, 1), ("dp", "fsdp", "cp"), axis_types=(AxisType.Explicit,) * 3)
    model8, params8 = from_pretrained(folder, mesh=mesh, rules=fsdp_rules())
    # Really sharded: every 2-D+ weight is split 8 ways along D (=64), each device holding 1/8 of it.
    wq = params8.layers.wq  # [L, D, H, Dh]
    assert len(wq.addressable_shards) == 8
    assert {s.data.shape for s in wq.addressable_shards} == {(wq.shape[0], wq.shape[1] // 8, *wq.shape[2:])}
    assert {s.data.shape for s in params8.embed.addressable_shards} == {(params8.embed.shape[0], 8)}
    assert {s.data.shape for s in params8.lm_head.addressable_shards} == {(8, params8.lm_head.shape[1])}
    toks, lens = ragged_batch(model1.cfg.vocab_size, [16, 9, 3, 12, 8, 16, 1, 5])
    ref, _ = model1.apply(params1, jnp.asarray(toks), jnp.asarray(lens))
    with jax.set_mesh(mesh):
        out, _ = jax.jit(model8.apply)(params8, jnp.asarray(toks), jnp.asarray(lens))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)


def test_tensor_parallel_load(folder):
    model1, params1 = from_pretrained(folder)
    mesh = jax.make_mesh((2,), ("tp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    model2, params2 = from_pretrained(folder, mesh=mesh, rules=tensor_parallel_rules())
    wq = params2.layers.wq
    assert {s.data.shape for s in wq.addressable_shards} == {(wq.shape[0], wq.shape[1], wq.shape[2] // 2, wq.shape[3])}
    toks, lens = ragged_batch(model1.cfg.vocab_size, [11, 4])
    ref, _ = model1.apply(params1, jnp.asarray(toks), jnp.asarray(lens))
    with jax.set_mesh(mesh):
        out, _ = jax.jit(model2.apply)(params2, jnp.asarray(toks), jnp.asarray(lens))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)
