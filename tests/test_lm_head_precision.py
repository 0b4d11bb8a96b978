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
