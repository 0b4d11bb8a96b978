"""Which implementation runs the attention of a cache-free call (training, a prefill), per platform.

The choice is a pure function of (platform, dtype, shapes): `choose`, whose every answer carries its reason, so a
test can check it on a machine without the accelerator it is about.

- 'reference': `attention.attention`, the masked softmax that every other path is tested against.
- 'flash': the Pallas TPU kernel (models/flash.py), only where the model asks for it (`Model.flash`) and the
  sequence divides into its tiles; TPU only.
- 'cudnn': `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's fused flash attention on NVIDIA GPUs:
  no [T, T] scores in HBM, causal blocks skipped, GQA without repeating KV heads. It takes bf16/fp16 only, and a
  head dim that is a multiple of 8 and at most 128 (256 on Hopper, which we cannot tell without the device:
  128 is the bound we check).
- 'xla': `jax.nn.dot_product_attention(implementation="xla")`, JAX's portable version of the same call. It is
  never chosen by 'auto' (on a GPU it does what the reference does), but it runs on every backend, so on a CPU it
  checks the call signature, masks and GQA layout that the cuDNN path uses.

Cached attention (decode, extend) is not dispatched here: the cache is stored [L, B, K, S, Dh] and read only up to
the longest live row (`attention.cached_attention`), which cuDNN's BTNH call would need a full transposed copy of
the cache to do, every step. Decoding is HBM-bound; the blocked XLA read is what fits it.

Both library paths are given the keys' lengths only (`key_value_seq_lengths`), never the queries': then a padding
query sees every real key at or before it, exactly as in the reference, rather than a fully masked row.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from asyncrl.models.attention import attention
from asyncrl.models.flash import block_size, flash_attention_train

IMPLEMENTATIONS = ("auto", "reference", "xla", "cudnn")
"""Values of `Model.attention_impl`: 'auto' calls `choose` at trace time; the others force one path."""

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 128


@dataclass(frozen=True)
class Choice:
    impl: str
    reason: str


def choose(platform: str, dtype: jnp.dtype, q_shape: tuple[int, ...], k_shape: tuple[int, ...]) -> Choice:
    """The implementation 'auto' picks for q [B, T, H, Dh], k [B, T, K, Dh] of `dtype` on `platform`
    ('cpu', 'tpu', 'gpu'; a CUDA device reports 'gpu')."""
    H, Dh = q_shape[2], q_shape[3]
    K = k_shape[2]
    if platform != "gpu":
        return Choice("reference", f"{platform}: the reference (TPU's flash kernel is chosen by Model.flash)")
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in CUDNN_DTYPES]:
        return Choice("reference", f"gpu, {jnp.dtype(dtype).name}: cuDNN flash attention takes bf16/fp16 only")
    if Dh % 8 or Dh > CUDNN_MAX_HEAD_DIM:
        return Choice("reference", f"gpu, head dim {Dh}: cuDNN needs a multiple of 8, <= {CUDNN_MAX_HEAD_DIM}")
    if H % K:
        return Choice("reference", f"gpu, {H} query heads over {K} KV heads: not a whole GQA group")
    return Choice("cudnn", f"gpu, {jnp.dtype(dtype).name}, head dim {Dh}, GQA {H}/{K}: cuDNN flash attention")


def platform() -> str:
    """The platform a trace is for: the ambient mesh's devices if it names them (an AOT lowering for a TPU slice
    on a CPU host names the TPU), else JAX's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)  # not in every jax version
    return device.platform if device is not None else jax.default_backend()


def _library(q: jax.Array, k: jax.Array, v: jax.Array, lens: jax.Array, impl: str) -> jax.Array:
    """One device's share through `jax.nn.dot_product_attention` (BTNH, the model's own layout)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lens.astype(jnp.int32),
                                        implementation=impl).astype(q.dtype)


def _per_device(q: jax.Array, k: jax.Array, v: jax.Array, lens: jax.Array, impl: str) -> jax.Array:
    """Under an Explicit mesh the library call runs per device, over q's own layout (as the flash kernel does):
    cuDNN's partitioner wants q, k, v sharded alike and would otherwise see KV heads laid out apart from queries."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.explicit_axes:
        return _library(q, k, v, lens, impl)
    b_spec, t_spec, h_spec, _ = jax.typeof(q).sharding.spec
    if t_spec is not None:
        raise ValueError(f"attention '{impl}' needs whole sequences: reshard q, k, v to heads first (Ulysses)")
    if jax.typeof(k).sharding.spec[2] != h_spec:
        k, v = (jax.sharding.reshard(x, P(b_spec, None, h_spec, None)) for x in (k, v))
    lens = jax.sharding.reshard(lens, P(b_spec))
    spec = P(b_spec, None, h_spec, None)
    return jax.shard_map(lambda *a: _library(*a, impl), in_specs=(spec, spec, spec, P(b_spec)), out_specs=spec,
                         check_vma=False)(q, k, v, lens)


def self_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, lens: jax.Array, flash: bool,
                   impl: str = "auto") -> jax.Array:
    """Causal attention of a cache-free call over its own tokens. q [B, T, H, Dh], k, v [B, T, K, Dh], q_pos
    [B, T] (= 0..T-1), lens [B] -> [B, T, H, Dh]. `flash` (Model.flash) takes the Pallas kernel where T fits its
    tiles; otherwise `impl` ('auto': `choose` for this trace's platform) picks the path."""
    if flash and block_size(q.shape[1]) is not None:
        return flash_attention_train(q, k, v, lens)  # never writes [T, T] scores to HBM
    if impl == "auto":
        impl = choose(platform(), q.dtype, q.shape, k.shape).impl
    if impl == "reference":
        return attention(q, k, v, q_pos, lens)
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"Model.attention_impl={impl!r} must be one of {IMPLEMENTATIONS}")
    return _per_device(q, k, v, lens, impl)
