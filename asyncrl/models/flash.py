"""Training attention on TPU: JAX's Pallas flash-attention kernel, under the model's explicit sharding.

The reference `attention` (models/attention.py) writes fp32 [T, T] scores per head group to HBM, and the backward
reads them again: at T=4096 that traffic, not the matmuls, bounds a Qwen3-8B train step. The Pallas kernel
(`jax.experimental.pallas.ops.tpu.flash_attention`) keeps each score block in VMEM with an online softmax, skips
the blocks above the causal diagonal, and has its own backward kernels.

Semantics match the cache-free forward of `Model.apply`: row b's queries see keys j <= t with j < len[b]. The
kernel has no length argument; segment ids give the same visibility to every real token (segment 1 = the first
len[b] tokens). Padding queries (segment 0) attend only padding keys, so their outputs differ from the
reference's, but nothing reads them: they are right padding, masked out of every loss and metric.

The kernel wants [B, H, T, Dh] with as many KV heads as query heads, so GQA heads are repeated first; it runs
per device under `jax.shard_map` over the batch axes (and the heads axes after a Ulysses all-to-all).
On a CPU the same kernel runs in Pallas' TPU interpret mode (`jax.experimental.pallas.tpu.
force_tpu_interpret_mode`), which is how the tests check it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

_BLOCKS = (512, 256, 128)


def block_size(T: int) -> int | None:
    """The largest kernel tile that divides T, or None (the caller then uses the reference attention)."""
    return next((b for b in _BLOCKS if T % b == 0), None)


def _blocks(T: int):
    from jax.experimental.pallas.ops.tpu.flash_attention import BlockSizes

    b = block_size(T)
    return BlockSizes(block_q=b, block_k_major=b, block_k=b, block_b=1, block_q_major_dkv=b, block_k_major_dkv=b,
                      block_k_dkv=b, block_q_dkv=b, block_k_major_dq=b, block_k_dq=b, block_q_dq=b)


def _local(q: jax.Array, k: jax.Array, v: jax.Array, lens: jax.Array) -> jax.Array:
    """One device's share: q [b, T, h, Dh], k, v [b, T, kh, Dh] (kh divides h), lens [b] -> [b, T, h, Dh]."""
    from jax.experimental.pallas.ops.tpu.flash_attention import SegmentIds, flash_attention

    T, h, Dh = q.shape[1], q.shape[2], q.shape[3]
    if k.shape[2] != h:  # consecutive query heads share a KV head, as in the reference's grouping
        k, v = (jnp.repeat(x, h // k.shape[2], axis=2) for x in (k, v))
    seg = (jnp.arange(T, dtype=jnp.int32)[None, :] < lens[:, None]).astype(jnp.int32)  # [b, T]
    to_bhtd = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    out = flash_attention(to_bhtd(q), to_bhtd(k), to_bhtd(v), segment_ids=SegmentIds(seg, seg), causal=True,
                          sm_scale=float(1 / np.sqrt(Dh)), block_sizes=_blocks(T))
    return to_bhtd(out).astype(q.dtype)


def flash_attention_train(q: jax.Array, k: jax.Array, v: jax.Array, lens: jax.Array) -> jax.Array:
    """Causal attention of a cache-free forward. q [B, T, H, Dh], k, v [B, T, K, Dh], lens [B] -> [B, T, H, Dh].

    Under an Explicit mesh the kernel runs per device over q's own layout (B over the batch axes, heads whole or
    split over the Ulysses axes, T whole); without one it runs on the default device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.explicit_axes:
        return _local(q, k, v, lens)
    b_spec, t_spec, h_spec, _ = jax.typeof(q).sharding.spec
    if t_spec is not None:
        raise ValueError("flash attention needs whole sequences: reshard q, k, v to heads first (Ulysses)")
    kv_spec = jax.typeof(k).sharding.spec[2]
    if kv_spec != h_spec:  # KV heads laid out apart from query heads (e.g. replicated): align them
        k, v = (jax.sharding.reshard(x, P(b_spec, None, h_spec, None)) for x in (k, v))
    lens = jax.sharding.reshard(lens, P(b_spec))
    spec = P(b_spec, None, h_spec, None)
    # check_vma=False: the Pallas call's outputs carry no varying-axes annotation for shard_map to check.
    return jax.shard_map(_local, in_specs=(spec, spec, spec, P(b_spec)), out_specs=spec, check_vma=False)(
        q, k, v, lens)
