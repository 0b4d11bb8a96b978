"""Why the fused LM head runs at Precision.HIGH: on TPU an f32 matmul at DEFAULT precision is one bf16 pass, HIGH
is three (bf16_3x: hi*hi + hi*lo + lo*hi), HIGHEST six. The CPU computes every precision exactly, so the TPU
passes are emulated here in NumPy on Qwen-like logits, against a float64 reference."""

import ml_dtypes
import numpy as np

from asyncrl.ops.logprobs import LM_HEAD_PRECISION


def _bf16(x):
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def _logprobs(logits, targets):
    m = logits.max(-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(logits - m).sum(-1))
    return logits[np.arange(len(targets)), targets] - lse


def test_one_bf16_pass_is_too_coarse_and_three_are_enough():
    rng = np.random.default_rng(0)
    n, d, v = 64, 2048, 8192
    h = _bf16(rng.normal(size=(n, d)).astype(np.float32))  # bf16 activations, as the trainer's compute dtype
    W = (rng.normal(size=(d, v)) * 0.12).astype(np.float32)  # logits with std ~5, Qwen-like
    targets = rng.integers(0, v, n)
    ref = _logprobs(h.astype(np.float64) @ W.astype(np.float64), targets)
    one_pass = _logprobs(_bf16(h) @ _bf16(W), targets)
    hi_h, hi_w = _bf16(h), _bf16(W)
    lo_h, lo_w = _bf16(h - hi_h), _bf16(W - hi_w)
    three_pass = _logprobs(hi_h @ hi_w + hi_h @ lo_w + lo_h @ hi_w, targets)
    assert np.abs(one_pass - ref).max() > 1e-2  # an importance ratio off by more than 1%
    assert np.abs(three_pass - ref).max() < 1e-4
    assert str(LM_HEAD_PRECISION) == "HIGH"


def test_logits_precision_reaches_every_lm_head_matmul_and_is_validated():
    """`model.logits_precision` (issue #39): the fused head's forward and backward matmuls all run at the chosen
    precision (what the TPU compiler, and `launch.py aot`'s MXU-pass count, see); a bad value names the field."""
    import jax
    import jax.numpy as jnp
    import pytest

    from asyncrl.models.config import ModelConfigError
    from asyncrl.models.section import ModelSection
    from asyncrl.ops.logprobs import LOGITS_PRECISIONS, fused_logprobs_and_entropy

    h, W, t = jnp.ones((8, 4)), jnp.ones((4, 16)), jnp.zeros(8, jnp.int32)
    for name, want in (("high", "HIGH"), ("default", "DEFAULT")):
        grad = jax.grad(lambda h, W, p=LOGITS_PRECISIONS[name]: fused_logprobs_and_entropy(h, W, t, 4, p)[0].sum(),
                        argnums=(0, 1))
        text = str(jax.make_jaxpr(grad)(h, W))
        precisions = [line.strip() for line in text.splitlines() if "precision=" in line]
        assert len(precisions) == 4, text  # forward, recomputed logits, dh, dW
        assert all(want in p for p in precisions), precisions
    assert ModelSection().logits_precision == "high"
    with pytest.raises(ModelConfigError, match=r"model\.logits_precision='fast'"):
        ModelSection(logits_precision="fast")
