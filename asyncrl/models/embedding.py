"""The token-embedding lookup under an Explicit mesh (`Model._embed`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def lookup(embed: jax.Array, x: jax.Array, mesh: Any, ids_spec: P, rows_spec: P) -> jax.Array:
    """[B, T] ids (laid out as `ids_spec`) -> [B, T, D] rows of the table (`rows_spec`). `embed` is the compute
    view of the table: FSDP shards already gathered, a tensor-parallel vocab split kept."""
    x = jax.sharding.reshard(x, ids_spec)
    spec = jax.typeof(embed).sharding.spec
    vocab, width = spec.partitions[0], spec.partitions[1]
    if vocab is None or width is not None:  # the lookup wants the whole table
        if vocab is not None or width is not None:
            embed = jax.sharding.reshard(embed, P())
        return embed.at[x].get(out_sharding=rows_spec)
    # Vocab split over model axes (tp): each device looks up the ids it holds and a psum of the [B, T, D]
    # rows (one nonzero term each, so exact) replaces an all-gather of the whole table on every call.
    axes = (vocab,) if isinstance(vocab, str) else tuple(vocab)

    def local(table: jax.Array, ids: jax.Array) -> jax.Array:
        n = table.shape[0]
        rel = ids - jax.lax.axis_index(axes) * n
        mine = (rel >= 0) & (rel < n)
        rows = jnp.take(table, jnp.clip(rel, 0, n - 1), axis=0)
        return jax.lax.psum(jnp.where(mine[..., None], rows, jnp.zeros((), rows.dtype)), axes)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(vocab, None), ids_spec), out_specs=rows_spec)(embed, x)
