"""Fixed-shape KV cache: allocated once, written in place by row, donated through jitted loops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

# Logical axes of the cache leaves, for the sharding rules table.
KV_AXES = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")
LENGTH_AXES = ("batch",)


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    k: Any  # [L, B, S, K, Dh]
    v: Any  # [L, B, S, K, Dh]
    length: Any  # [B] int32: valid positions per row; the next token of row b is written at length[b]

    @property
    def max_length(self) -> int:
        return self.k.shape[2]


def write_rows(cache_l: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write new[b] ([T, K, Dh]) into cache_l[b] ([S, K, Dh]) at row offset start[b], for every row b."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.explicit_axes:
        # The update must be laid out like the cache (batch rows and KV heads on the same devices).
        new = jax.sharding.reshard(new, jax.typeof(cache_l).sharding.spec)
    return jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), s, axis=0))(cache_l, new, start)
