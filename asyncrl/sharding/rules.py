"""The one table that maps logical array axes to mesh axes.

Every param / cache / batch leaf carries a tuple of *logical* axis names (see `models/params.py`). A
`ShardingRules` instance says which mesh axis each logical name is split over. Training (FSDP), inference
(tensor parallel) and data parallel are just different instances of this table over the same model code,
as tunix keeps separate training and sampling shardings.

Rules raise when one array would put two of its dimensions on the same mesh axis, which XLA would otherwise
reject much later with a less helpful message.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

log = logging.getLogger(__name__)

MeshAxes = str | tuple[str, ...] | None

# Logical axis names used across the code base.
LOGICAL_AXES = (
    "layers",  # stacked decoder blocks
    "vocab",  # embedding rows / LM head columns
    "embed",  # residual width D
    "heads",  # query heads H
    "kv_heads",  # key/value heads K
    "head_dim",  # per-head width
    "mlp",  # SwiGLU hidden F
    "batch",  # sequences
    "seq",  # positions
    "cache_seq",  # KV-cache positions
    "lora_rank",  # a LoRA adapter's rank r (models/lora.py): small, never split
    "expert",  # a mixture-of-experts layer's experts E (models/moe.py): expert parallelism
)


class ShardingRuleError(ValueError):
    pass


@dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis (or tuple of mesh axes, or None for replicated)."""

    layers: MeshAxes = None
    vocab: MeshAxes = None
    embed: MeshAxes = None
    heads: MeshAxes = None
    kv_heads: MeshAxes = None
    head_dim: MeshAxes = None
    mlp: MeshAxes = None
    batch: MeshAxes = None
    seq: MeshAxes = None
    cache_seq: MeshAxes = None
    lora_rank: MeshAxes = None
    expert: MeshAxes = None
    min_bytes: int = 0
    """Leaves smaller than this are replicated: sharding a tiny norm scale only adds collective latency."""

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        if logical is None:
            return ()
        if logical not in LOGICAL_AXES:
            raise ShardingRuleError(f"unknown logical axis {logical!r}; known: {LOGICAL_AXES}")
        value = getattr(self, logical)
        if value is None:
            return ()
        return (value,) if isinstance(value, str) else tuple(value)

    def spec(
        self,
        logical_axes: Sequence[str | None],
        shape: Sequence[int] | None = None,
        mesh: Mesh | None = None,
        nbytes: int | None = None,
        name: str = "array",
    ) -> P:
        """PartitionSpec for one array. With `shape` and `mesh`, dims that don't divide evenly stay replicated."""
        if nbytes is not None and nbytes < self.min_bytes:
            return P(*([None] * len(logical_axes)))
        used: dict[str, str] = {}
        out: list[Any] = []
        for dim, logical in enumerate(logical_axes):
            # Size-1 mesh axes split nothing; leaving them out keeps specs free of spurious conflicts.
            axes = tuple(a for a in self.mesh_axes(logical) if mesh is None or (a in mesh.shape and mesh.shape[a] > 1))
            for a in axes:
                if a in used:
                    raise ShardingRuleError(
                        f"{name}: logical axes {used[a]!r} and {logical!r} both map to mesh axis {a!r}"
                    )
            if axes and shape is not None and mesh is not None:
                size = int(np.prod([mesh.shape[a] for a in axes]))
                if shape[dim] % size != 0:
                    # Keep correctness: an uneven dim is replicated rather than failing (e.g. 2 KV heads, tp=4).
                    log.debug("%s: dim %d (%s=%d) not divisible by %s=%d; replicated", name, dim, logical,
                              shape[dim], axes, size)
                    axes = ()
            for a in axes:
                used[a] = logical  # type: ignore[assignment]
            out.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
        return P(*out)

    def sharding(self, mesh: Mesh, logical_axes: Sequence[str | None], shape: Sequence[int],
                 nbytes: int | None = None, name: str = "array") -> NamedSharding:
        return NamedSharding(mesh, self.spec(logical_axes, shape, mesh, nbytes, name))

    def replace(self, **kw: Any) -> ShardingRules:
        return dataclasses.replace(self, **kw)


def spec_entry(axes: Sequence[str]) -> Any:
    """Mesh axes -> one PartitionSpec entry (None, one axis name, or a tuple of them)."""
    return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


def drop_axes(entry: Any, drop: set[str]) -> Any:
    """A PartitionSpec entry without the mesh axes in `drop`."""
    if entry is None:
        return None
    return spec_entry(tuple(a for a in ((entry,) if isinstance(entry, str) else entry) if a not in drop))


# ---- Rule instances -----------------------------------------------------------------------------------------

def fsdp_rules(fsdp_axis: str = "fsdp", shard_logical: str = "embed", min_bytes: int = 0,
               data_axes: MeshAxes = ("dp", "fsdp")) -> ShardingRules:
    """FSDP: each weight is split along one chosen logical dim (default the residual width D) over `fsdp`.

    Either rule instance here takes expert parallelism as `.replace(expert="expert")`: a MoE layer's experts split
    over that mesh axis, which is not a data axis (tokens are replicated over it; `models/moe.py`)."""
    rules = ShardingRules(batch=data_axes, min_bytes=min_bytes)
    return rules.replace(**{shard_logical: fsdp_axis})


def tensor_parallel_rules(tp_axis: str = "tp", data_axis: str | None = None) -> ShardingRules:
    """Megatron-style TP for inference: heads, KV heads and the MLP hidden are split; the batch over `dp`."""
    return ShardingRules(heads=tp_axis, kv_heads=tp_axis, mlp=tp_axis, vocab=tp_axis, batch=data_axis)


def tree_shardings(rules: ShardingRules, mesh: Mesh, abstract_tree: Any, axes_tree: Any) -> Any:
    """NamedShardings for a whole tree from its abstract (ShapeDtypeStruct) tree and logical-axes tree."""

    def one(path, leaf, axes):
        nbytes = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        return rules.sharding(mesh, axes, leaf.shape, nbytes, name=jax.tree_util.keystr(path))

    return jax.tree_util.tree_map_with_path(one, abstract_tree, axes_tree,
                                            is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
