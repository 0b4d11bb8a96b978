"""Bring a (possibly multi-host) array whole onto this host.

A multi-host array is replicated over *its own* mesh only, by a jitted identity onto `P()`: a job-wide allgather
(`multihost_utils.process_allgather`) would wait for processes (inference hosts) that never call it. The identity
is jitted once per mesh, so calling this every step costs no retracing.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


@functools.cache
def _replicate(mesh: Mesh) -> Any:
    return jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, P()))


def to_host(x: Any) -> np.ndarray:
    """The whole of `x` as a NumPy array on this host (every process owning part of `x`'s mesh must call it)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(_replicate(x.sharding.mesh)(x).addressable_data(0))
