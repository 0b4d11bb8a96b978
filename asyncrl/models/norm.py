"""RMSNorm as Hugging Face computes it."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """HF RMSNorm: normalize in fp32, cast back, then scale (the cast order matters for bf16 parity)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * xf.astype(x.dtype)
