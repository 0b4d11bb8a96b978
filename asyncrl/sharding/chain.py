"""The layout every leaf of a weight sync travels in: split over all of a slot's chips along one dimension.

A pure function of the leaf's shape and the mesh's size, so every process of the job (senders, forwarders and
receivers alike, which see shapes only) derives the same one. The trainer's cast writes straight into it on the
trainer mesh (`Trainer.sync_payload`), and the hop chain moves it (`weightsync/transfer.py`): it lives here, in the
sharding unit below both, because both must agree on it.

The split dimension is the first one after the first that the mesh's chip count divides. Never the first: the
chain cuts a leaf larger than a bucket into row ranges along its first axis (the stacked layer axis), and a cut
along an unsplit axis is a local slice on every chip. A leaf with no such dimension (norm scales of odd sizes,
scalars) travels replicated.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def chain_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """The sync layout of a leaf of `shape` over `mesh`: one dimension split over all of its axes, in the mesh's
    order, so that shard k lies on `mesh.devices.flat[k]` whatever the mesh's shape. Over the trainer's
    ("dp", "fsdp", "expert", "cp") mesh and over a slot's 1-D mesh of the same devices in the same order this is
    the same placement, which is what lets the trainer's cast output leave as the first hop's input."""
    n = mesh.devices.size
    names = tuple(mesh.axis_names)
    for axis in range(1, len(shape)):
        if shape[axis] % n == 0:
            return NamedSharding(mesh, P(*([None] * axis), names if len(names) > 1 else names[0]))
    return NamedSharding(mesh, P())


def chain_shardings(mesh: Mesh, tree: Any) -> Any:
    """`chain_sharding` for every leaf of a tree of arrays or ShapeDtypeStructs."""
    return jax.tree.map(lambda a: chain_sharding(mesh, tuple(a.shape)), tree)
