"""The trainer's mesh, its shardings, and how each host's local batch becomes one global array.

Mesh axes are ("dp", "fsdp", "expert", "cp"), all `AxisType.Explicit`:
- dp: pure data parallel; params are replicated over it.
- fsdp: the batch *and* params/optimizer state are split over it; `Model._use` all-gathers a weight right
  before use, and XLA reduce-scatters its gradient back.
- expert: expert parallelism. A mixture-of-experts layer's experts (and their optimizer state) are split over it,
  and stay split in use (`Model._use` gathers only their fsdp shards); every other weight is replicated over it.
  The batch splits over it like over dp, so outside the MoE layers it is one more data axis; inside one, each
  device all-gathers its expert group's tokens, runs those routed to its own experts and reduce-scatters the sum
  back (`models/moe.py`). At expert = 1 nothing is split over it and the layouts are the dense ones.
- cp: context (sequence) parallel, Ulysses style. The rules table maps the logical axis "seq" to it, so the
  sequence dim of the batch's [B, T] leaves and of every training activation [B, T, ...] is split over cp.
  Around attention an all-to-all swaps that split for a split over heads, attention runs on whole sequences,
  and a second all-to-all swaps back (`models/ulysses.py`). Params and optimizer state are replicated
  over cp (FSDP shards them over fsdp only), so cp cuts activation memory, not state memory; XLA reduces
  gradients over (dp, fsdp, cp). Constraints: num_heads divides by cp (KV heads need not: they are repeated
  up to a multiple of cp); a batch's padded length T divides by cp (`shard_batch` raises otherwise: make
  `train.pad_to_multiple` a multiple of cp); each cp group of devices lies within one process (checked by
  `make_shardings`; cp is the innermost mesh axis, so on ordinary hosts it does). At cp = 1 nothing is split
  over it and the layouts are exactly the batch-only ones.

Param shardings come from the one rules table (`asyncrl/sharding/rules.py`): `fsdp_rules` splits each weight's
`ShardingConfig.fsdp_axis` dimension over "fsdp" when the leaf is at least `min_bytes_for_fsdp` bytes. Norm
scales have no logical axis besides "layers", so 1-D-per-layer leaves always stay replicated.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from asyncrl.models.params import Params
from asyncrl.sharding.axes import CP_AXIS, DATA_AXES, EXPERT_AXIS, MESH_AXES
from asyncrl.sharding.host import to_host
from asyncrl.sharding.rules import ShardingRules, fsdp_rules
from asyncrl.train.config import MeshConfig, ShardingConfig

log = logging.getLogger(__name__)



def make_train_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("dp", "fsdp", "expert", "cp") Explicit mesh over `devices` (default: every device of every process)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = cfg.resolve(len(devices))
    types = (AxisType.Explicit,) * len(MESH_AXES)
    try:
        mesh = jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices)
    except (ValueError, NotImplementedError) as e:
        # make_mesh wants physical-topology-friendly shapes; a hand-picked device subset may not be one.
        log.info("jax.make_mesh(%s) failed (%s); building the mesh in the given device order", shape, e)
        return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=types)
    cp_groups = mesh.devices.reshape(-1, shape[-1])
    if shape[-1] > 1 and any(len({d.process_index for d in g}) > 1 for g in cp_groups):
        # make_mesh laid cp along a torus dimension that crosses hosts (e.g. z on a v5p slice); cp groups must
        # stay within a host (see the module docstring), so order the devices host by host instead: a host's
        # chips are ICI neighbours, which is where Ulysses' all-to-alls belong anyway.
        ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
        mesh = Mesh(np.asarray(ordered).reshape(shape), MESH_AXES, axis_types=types)
    return mesh


def train_rules(cfg: ShardingConfig) -> ShardingRules:
    return fsdp_rules(fsdp_axis="fsdp", shard_logical=cfg.fsdp_axis, min_bytes=cfg.min_bytes_for_fsdp,
                      data_axes=DATA_AXES).replace(seq=CP_AXIS, expert=EXPERT_AXIS)


def _seq_axes(mesh: Mesh, cfg: ShardingConfig) -> tuple[str, ...]:
    """Mesh axes that split the sequence dim in training: "seq"'s axes of size > 1 (empty at cp = 1)."""
    return tuple(a for a in train_rules(cfg).mesh_axes("seq") if a in mesh.shape and mesh.shape[a] > 1)


def trainer_processes(mesh: Mesh) -> list[int]:
    """Process indices that own devices of `mesh` (inference hosts of the same jax.distributed job do not)."""
    return sorted({d.process_index for d in mesh.devices.flat})


def host_allgather(values: np.ndarray, mesh: Mesh) -> np.ndarray:
    """Each host's [k] float32 values -> [n_hosts, k] on every host of `mesh`, in process-index order.

    A collective over the mesh's devices only: `multihost_utils.process_allgather` would wait for every process
    of the job, including inference hosts that never call it."""
    values = np.asarray(values, np.float32).reshape(1, -1)
    flat = list(mesh.devices.flat)
    n_local = sum(d.process_index == jax.process_index() for d in flat)
    spread = NamedSharding(mesh, P(MESH_AXES, None))  # row i lives on device flat[i]
    rows = jax.make_array_from_process_local_data(spread, np.repeat(values, n_local, axis=0),
                                                  (len(flat), values.shape[1]))
    rows = to_host(rows)  # [n_devices, k], each host's row repeated per device
    first: dict[int, int] = {}
    for i, d in enumerate(flat):
        first.setdefault(d.process_index, i)
    return rows[[first[p] for p in sorted(first)]]


def supports_memory_kind(mesh: Mesh, kind: str) -> bool:
    return all(kind in {m.kind for m in d.addressable_memories()} for d in mesh.devices.flat
               if d.process_index == jax.process_index())


@dataclass(frozen=True)
class TrainShardings:
    """Where every piece of trainer state lives (the blog's `Shardings`)."""

    mesh: Mesh
    params: Params  # of NamedSharding
    opt_state: Any  # optax state of NamedSharding; pinned_host memory when `offloaded`
    opt_state_compute: Any  # the same in device memory, where the update runs
    replicated: NamedSharding
    offloaded: bool
    seq_axes: tuple[str, ...] = ()
    """Mesh axes that split the sequence dim (dim 1) of [B, T, ...] batch leaves; empty without CP."""

    @property
    def seq_parallel(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.seq_axes)

    def batch(self, ndim: int) -> NamedSharding:
        """Batch leaves: dim 0 over all data axes, dim 1 (the sequence) over `seq_axes`, the rest whole."""
        seq = None if not self.seq_axes else (self.seq_axes[0] if len(self.seq_axes) == 1 else self.seq_axes)
        return NamedSharding(self.mesh, P(DATA_AXES, *([seq] if ndim > 1 else []), *([None] * (ndim - 2))))


def opt_state_shardings(tx: optax.GradientTransformation, params_abstract: Params, param_shardings: Params,
                        replicated: NamedSharding) -> Any:
    """Optimizer state follows params: every param-shaped subtree (mu, nu) takes the param shardings, the rest
    (step counts) is replicated. optax knows which subtrees are param-shaped; shape matching would not."""
    state_abstract = jax.eval_shape(tx.init, params_abstract)
    # A leaf that a multi_transform holds no state for (LoRA's frozen A) is an empty MaskedNode: it stays one.
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    return optax.tree_map_params(tx, lambda v, s: v if masked(v) else s, state_abstract, param_shardings,
                                 transform_non_params=lambda _: replicated, is_leaf=masked)


def _check_cp_groups_local(mesh: Mesh, axes: tuple[str, ...]) -> None:
    """`shard_batch` gives each process's rows to its own devices, whole along T; a cp group spanning processes
    would need rows from two hosts at once."""
    if not axes:
        return
    groups = np.moveaxis(mesh.devices, [mesh.axis_names.index(a) for a in axes], -1)
    for group in groups.reshape(-1, math.prod(mesh.shape[a] for a in axes)):
        if len({d.process_index for d in group}) > 1:
            raise ValueError(f"sharding.mesh.cp_ulysses: the devices of one context-parallel group belong to "
                             f"processes {sorted({d.process_index for d in group})}; keep cp within one host")


def make_shardings(mesh: Mesh, param_shardings: Params, params_abstract: Params,
                   tx: optax.GradientTransformation, cfg: ShardingConfig) -> TrainShardings:
    seq = _seq_axes(mesh, cfg)
    _check_cp_groups_local(mesh, seq)
    replicated = NamedSharding(mesh, P())
    opt = opt_state_shardings(tx, params_abstract, param_shardings, replicated)
    offloaded = False
    stored = opt
    if cfg.opt_state_offload:
        if supports_memory_kind(mesh, "pinned_host"):
            stored = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), opt)
            offloaded = True
        else:
            log.warning("sharding.opt_state_offload: devices %s have no pinned_host memory; optimizer state stays "
                        "in device memory", mesh.devices.flat[0].platform)
    return TrainShardings(mesh, param_shardings, stored, opt, replicated, offloaded, seq)


def shard_batch(batch: Any, shardings: TrainShardings) -> Any:
    """Each host's local numpy batch (same shapes on every host) -> one global array per leaf.

    Each process's rows go straight onto its own devices in the training layout (`TrainShardings.batch`), in
    process order, with no transfer. Every leaf's dim 0 is the batch; its global size is the local size times
    the number of processes. With context parallelism, dim 1 of leaves with 2+ dims is the sequence and must
    divide by cp."""
    mesh = shardings.mesh
    n_hosts = len(trainer_processes(mesh))
    cp = shardings.seq_parallel

    def put(x: np.ndarray) -> jax.Array:
        x = np.asarray(x)
        # Raise rather than pad here: the padded length is a loss normaliser (dr_grpo's constant 1 / (B * T)),
        # so padding for cp alone would change the loss that cp = 1 computes.
        if x.ndim > 1 and x.shape[1] % cp:
            raise ValueError(f"batch length T={x.shape[1]} does not divide over sharding.mesh.cp_ulysses={cp}: "
                             f"set train.pad_to_multiple to a multiple of {cp}")
        return jax.make_array_from_process_local_data(shardings.batch(x.ndim), x, (x.shape[0] * n_hosts, *x.shape[1:]))

    return jax.tree.map(put, batch)
