"""`Model.get_logprobs` (now the fused chunked LM head) equals log_softmax of the full logits, sharded or not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from asyncrl.models import Model, preset
from asyncrl.sharding.rules import fsdp_rules
from tests.helpers import ragged_batch


def _reference(model: Model, params, tokens, lens, temperature: float) -> np.ndarray:
    logits, _ = model.apply(params, tokens, lens)  # [B, T, V] fp32
    lp = jax.nn.log_softmax(logits[:, :-1] / (temperature if temperature > 0 else 1.0), axis=-1)
    lp = np.take_along_axis(np.asarray(lp), np.asarray(tokens)[:, 1:, None], axis=-1)[..., 0]
    valid = np.arange(tokens.shape[1] - 1)[None, :] < (np.asarray(lens)[:, None] - 1)
    return np.where(valid, lp, 0.0)


def test_get_logprobs_matches_full_softmax():
    model = Model(preset("tiny"))
    params = model.init_params(jax.random.key(0))
    toks, lens = ragged_batch(model.cfg.vocab_size, [16, 9, 3, 12, 8, 16, 1, 5])
    toks, lens = jnp.asarray(toks), jnp.asarray(lens)
    get = jax.jit(model.get_logprobs, static_argnums=3)
    for temperature in (0.7, 0.0):  # 0 (greedy) is scored at temperature 1
        out = get(params, toks, lens, temperature)
        assert out.shape == (8, toks.shape[1] - 1)
        np.testing.assert_allclose(np.asarray(out), _reference(model, params, toks, lens, temperature), atol=1e-5)

    mesh = jax.make_mesh((2, 4, 1), ("dp", "fsdp", "cp"), axis_types=(AxisType.Explicit,) * 3)
    sharded = model.with_rules(fsdp_rules())
    with jax.set_mesh(mesh):
        p8 = jax.device_put(params, sharded.param_shardings(mesh))
        out8 = jax.jit(sharded.get_logprobs, static_argnums=3)(p8, toks, lens, 0.7)
    np.testing.assert_allclose(np.asarray(out8), _reference(model, params, toks, lens, 0.7), atol=1e-5)
