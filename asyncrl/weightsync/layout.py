"""The layout every leaf of a weight sync travels in: split over all of a slot's chips along one dimension.

A pure function of the leaf's shape and the mesh's size, so every process of the job (senders, forwarders and
receivers alike, which see shapes only) derives the same one. The trainer's cast writes straight into it, on the
trainer mesh (`Trainer.sync_payload`), so the first slot never holds a whole copy of the model: each trainer chip
holds 1/n of it, and each hop moves the model's bytes once (a replicated layout would move them once per
receiving chip). Receivers gather it whole after the last hop (`transfer.HopChainTransfer`).

The layout itself (`chain_sharding`) lives in `asyncrl/sharding/chain.py`, below the trainer and this package,
which must agree on it. Here: the buckets the chain pipelines (`plan_buckets`), whole leaves packed in order and a
leaf larger than a bucket cut into row ranges of its first axis.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# ------------------------------------------------------------------------------------------------ buckets


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of flat leaf `leaf` along its first axis (the whole leaf when it is not cut)."""

    leaf: int
    start: int
    stop: int
    shape: tuple[int, ...]
    dtype: Any
    whole: bool

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def plan_buckets(shapes: Sequence[jax.ShapeDtypeStruct], bucket_bytes: int) -> list[list[Piece]]:
    """Cut the flat leaves into buckets of at most `bucket_bytes` each (a single row larger than that is a bucket
    of its own). Deterministic in the shapes alone, so every process plans the same buckets. `bucket_bytes <= 0`:
    one bucket holding every leaf whole."""
    whole = lambda i, s: Piece(i, 0, s.shape[0] if s.shape else 1, tuple(s.shape), s.dtype, True)  # noqa: E731
    if bucket_bytes <= 0:
        return [[whole(i, s) for i, s in enumerate(shapes)]]
    buckets: list[list[Piece]] = []
    cur: list[Piece] = []
    used = 0

    def add(p: Piece) -> None:
        nonlocal cur, used
        if cur and used + p.nbytes > bucket_bytes:
            buckets.append(cur)
            cur, used = [], 0
        cur.append(p)
        used += p.nbytes

    for i, s in enumerate(shapes):
        nbytes = int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
        if nbytes <= bucket_bytes or not s.shape or s.shape[0] == 1:
            add(whole(i, s))
            continue
        rows = s.shape[0]
        per = max(1, bucket_bytes // (nbytes // rows))
        for a in range(0, rows, per):
            b = min(rows, a + per)
            add(Piece(i, a, b, (b - a, *s.shape[1:]), s.dtype, False))
    if cur:
        buckets.append(cur)
    return buckets


@functools.partial(jax.jit, static_argnums=(1, 2))
def take_rows(x: jax.Array, start: int, stop: int) -> jax.Array:
    return jax.lax.slice_in_dim(x, start, stop, axis=0)


@jax.jit
def concat_rows(*xs: jax.Array) -> jax.Array:
    return jnp.concatenate(xs, axis=0)
