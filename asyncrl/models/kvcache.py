"""Fixed-shape KV cache: allocated once, written in place by row, donated through jitted loops.

Leaves are [L, B, K, S, Dh] (see `attention.py`: the layout attention reads without a transpose). A forward
returns only its new tokens' K/V ([L, B, K, T, Dh]) from the layer loop and `write_new` puts them in once, so
the loop never copies a layer's cache out and back.

Per-layer form (the inference engine on the CPU, with per-layer weights: `params.unstack_layers`): k and v are
tuples of L arrays [1, B, K, S, Dh], each written in place by its own layer. Everything that works on rows
(axis 1) maps over the tuple.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from asyncrl.models.config import ModelConfig

# Logical axes of the cache leaves, for the sharding rules table.
KV_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")
LENGTH_AXES = ("batch",)


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    k: Any  # [L, B, K, S, Dh], or a tuple of L [1, B, K, S, Dh] (per-layer form)
    v: Any  # same as k
    length: Any  # [B] int32: valid positions per row; the next token of row b is written at length[b]

    @property
    def max_length(self) -> int:
        return jax.tree.leaves(self.k)[0].shape[3]


def zeros(cfg: ModelConfig, batch: int, length: int, dtype: Any, sharding: KVCache | None = None,
          per_layer: bool = False) -> KVCache:
    """Zeroed cache of `length` positions for a model config, placed by `sharding` (a KVCache of shardings) when
    given. `per_layer`: k and v are tuples of one [1, B, K, S, Dh] array per layer."""
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, length, cfg.head_dim)

    def make() -> KVCache:
        length0 = jnp.zeros((batch,), jnp.int32)
        if per_layer:
            z = tuple(jnp.zeros((1, *shape[1:]), dtype) for _ in range(cfg.num_layers))
            return KVCache(k=z, v=tuple(jnp.zeros_like(x) for x in z), length=length0)
        z = jnp.zeros(shape, dtype)
        return KVCache(k=z, v=z, length=length0)

    return make() if sharding is None else jax.jit(make, out_shardings=sharding)()


def shardings(cfg: ModelConfig, rules: Any, mesh: jax.sharding.Mesh, batch: int, length: int, per_layer: bool = False
              ) -> KVCache:
    """The cache's shardings from the rules table (logical axes KV_AXES, LENGTH_AXES)."""
    shape = (1 if per_layer else cfg.num_layers, batch, cfg.num_kv_heads, length, cfg.head_dim)
    kv = rules.sharding(mesh, KV_AXES, shape, name="kv_cache")
    if per_layer:
        kv = (kv,) * cfg.num_layers
    return KVCache(k=kv, v=kv, length=rules.sharding(mesh, LENGTH_AXES, (batch,), name="kv_cache.length"))


def write_new(cache_k: jax.Array, cache_v: jax.Array, new_k: jax.Array, new_v: jax.Array, start: jax.Array
              ) -> tuple[jax.Array, jax.Array]:
    """Write new[:, b] ([L, K, T, Dh]) into cache[:, b] ([L, K, S, Dh]) at position start[b], for every row b.

    A loop of in-place dynamic-update-slices over the rows a device holds. A batched scatter is what XLA makes
    of a vmapped update, and TPU lowers it through a batch-major copy of the whole cache: two transposes of
    every layer per step."""
    mesh = jax.sharding.get_abstract_mesh()
    new_k, new_v = new_k.astype(cache_k.dtype), new_v.astype(cache_v.dtype)
    if mesh.empty or not mesh.explicit_axes:
        return _write_rows(cache_k, cache_v, new_k, new_v, start)
    spec = jax.typeof(cache_k).sharding.spec
    rows = P(spec[1])
    new_k, new_v = jax.sharding.reshard(new_k, spec), jax.sharding.reshard(new_v, spec)
    return jax.shard_map(_write_rows, mesh=mesh, in_specs=(spec, spec, spec, spec, rows), out_specs=(spec, spec)
                         )(cache_k, cache_v, new_k, new_v, jax.sharding.reshard(start, rows))


def write_prefix(cache_k: jax.Array, cache_v: jax.Array, new_k: jax.Array, new_v: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
    """Write new [L, B, K, T, Dh] at positions 0..T-1 of every row (a prefill into empty rows)."""
    mesh = jax.sharding.get_abstract_mesh()
    out = []
    for c, n in ((cache_k, new_k), (cache_v, new_v)):
        n = n.astype(c.dtype)
        if not mesh.empty and mesh.explicit_axes:
            n = jax.sharding.reshard(n, jax.typeof(c).sharding.spec)
        out.append(jax.lax.dynamic_update_slice(c, n, (0, 0, 0, 0, 0)))
    return out[0], out[1]


def _write_rows(cache_k: jax.Array, cache_v: jax.Array, new_k: jax.Array, new_v: jax.Array, start: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    def row(b: jax.Array, caches: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        at = (0, b, 0, start[b], 0)
        return tuple(jax.lax.dynamic_update_slice(c, jax.lax.dynamic_slice_in_dim(n, b, 1, axis=1), at)
                     for c, n in zip(caches, (new_k, new_v)))

    # Several tokens a row (an extend: a continuation appended to parked caches, a few rows): unrolled. As a loop,
    # the TPU compiler fails on it for the 8B presets at some widths (an XLA RET_CHECK that swaps the loop's cache
    # output for its new-token operand). A decode step's one token a row keeps the loop, as it always had.
    unroll = cache_k.shape[1] if new_k.shape[3] > 1 and cache_k.shape[1] <= 16 else 1
    return jax.lax.fori_loop(0, cache_k.shape[1], row, (cache_k, cache_v), unroll=unroll)


def write_call(cache: KVCache, ks: jax.Array, vs: jax.Array, start: jax.Array, kv_len: jax.Array,
               at_lengths: bool) -> KVCache:
    """A stacked cache with one call's K/V [L, B, K, T, Dh] written at each row's length (`at_lengths`, a cached
    forward) or from position 0 (a prefill), its lengths `kv_len`."""
    with jax.named_scope("kv_write"):
        if at_lengths:
            k, v = write_new(cache.k, cache.v, ks, vs, start)
        else:
            k, v = write_prefix(cache.k, cache.v, ks, vs)
    return KVCache(k=k, v=v, length=kv_len)
