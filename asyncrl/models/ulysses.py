"""Context parallelism (Ulysses) for the cache-free (training) forward.

When the sharding rules map the logical axis "seq" onto mesh axes of size > 1 (the trainer's "cp"), the forward
keeps every [B, T, ...] activation split over T. Around attention an all-to-all turns q, k, v from
sequence-split [B, T/n, H, Dh] into head-split [B, T, H/n, Dh], attention runs on whole sequences locally, and a
second all-to-all turns its output back before `wo` (`Model._forward`). Calls with a KV cache (prefill, decode)
never split the sequence: CP is a training layout only.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from asyncrl.models.config import ModelConfig
from asyncrl.sharding.rules import spec_entry


def check(cfg: ModelConfig, T: int, seq: tuple[str, ...], mesh: Any) -> None:
    """A clear error, naming the config field, when the sequence or the heads do not divide over the cp axes."""
    n = math.prod(mesh.shape[a] for a in seq)
    if T % n:
        raise ValueError(f"sequence length {T} does not divide over the {n}-way context-parallel mesh axes {seq} "
                         f"(sharding.mesh.cp_ulysses): pad the batch to a multiple of {n} "
                         "(train.pad_to_multiple)")
    if cfg.num_heads % n:
        raise ValueError(f"num_heads={cfg.num_heads} does not divide over {n}-way context parallelism "
                         "(sharding.mesh.cp_ulysses): Ulysses splits attention heads over the cp axis")


def to_heads(q: jax.Array, k: jax.Array, v: jax.Array, mesh: Any, batch_axes: tuple[str, ...],
             seq: tuple[str, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sequence-split q [B, T/n, H, Dh], k, v [B, T/n, K, Dh] -> head-split [B, T, H/n, Dh], [B, T, K'/n, Dh].

    Each reshard lowers to one all-to-all over `seq`. When K does not divide by n (GQA with few KV heads),
    each KV head is first repeated r = n / gcd(K, n) times: K' = lcm(K, n) heads still serve consecutive
    groups of H / K' query heads, which is how `attention` groups them (r divides H / K because n divides
    H). A device then holds K' / n <= K heads of the whole sequence: never more traffic or memory than
    gathering k, v over the sequence, and the repeat's backward sums the copies' gradients."""
    n = math.prod(mesh.shape[a] for a in seq)
    r = n // math.gcd(k.shape[2], n)
    if r > 1:
        k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
    heads = P(spec_entry(batch_axes), None, spec_entry(seq), None)
    return tuple(jax.sharding.reshard(x, heads) for x in (q, k, v))  # type: ignore[return-value]
