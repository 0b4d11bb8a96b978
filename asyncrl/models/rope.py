"""Rotary position embeddings, HF layout (rotate-half, not interleaved), with Llama-3.1 frequency scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.models.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[Dh/2] inverse frequencies; computed once in NumPy (float32, as transformers does)."""
    dh = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dh, 2, dtype=np.int64).astype(np.float32) / dh))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq.astype(np.float32)
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    span = s.high_freq_factor - s.low_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / span
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [B, T, Dh] for integer positions [B, T]."""
    inv = jnp.asarray(inv_frequencies(cfg))
    freqs = positions.astype(jnp.float32)[..., None] * inv  # [B, T, Dh/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, N, Dh]; cos/sin: [B, T, Dh]. Math in fp32, result in x's dtype."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)
