"""The trainer's mesh, its shardings, and how each host's local batch becomes one global array.

Mesh axes are ("dp", "fsdp", "cp"), all `AxisType.Explicit`:
- dp: pure data parallel; params are replicated over it.
- fsdp: the batch *and* params/optimizer state are split over it; `Model._use` all-gathers a weight right
  before use, and XLA reduce-scatters its gradient back.
- cp: context (sequence) parallel for Ulysses attention. NOT implemented: the axis is kept (size 1, enforced
  by `MeshConfig`) so that meshes, checkpoints and configs keep their shape once it is.

Param shardings come from the one rules table (`asyncrl/sharding/rules.py`): `fsdp_rules` splits each weight's
`ShardingConfig.fsdp_axis` dimension over "fsdp" when the leaf is at least `min_bytes_for_fsdp` bytes. Norm
scales have no logical axis besides "layers", so 1-D-per-layer leaves always stay replicated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from asyncrl.models.params import Params
from asyncrl.sharding.host import to_host
from asyncrl.sharding.rules import ShardingRules, fsdp_rules
from asyncrl.train.config import MeshConfig, ShardingConfig

log = logging.getLogger(__name__)

MESH_AXES = ("dp", "fsdp", "cp")
DATA_AXES = ("dp", "fsdp")
"""Mesh axes that split the batch (Ulysses would add "cp" to the sequence dim, not to the batch)."""


def make_train_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("dp", "fsdp", "cp") Explicit mesh over `devices` (default: every device of every process)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = cfg.resolve(len(devices))
    types = (AxisType.Explicit,) * len(MESH_AXES)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices)
    except (ValueError, NotImplementedError) as e:
        # make_mesh wants physical-topology-friendly shapes; a hand-picked device subset may not be one.
        log.info("jax.make_mesh(%s) failed (%s); building the mesh in the given device order", shape, e)
        return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=types)


def train_rules(cfg: ShardingConfig) -> ShardingRules:
    return fsdp_rules(fsdp_axis="fsdp", shard_logical=cfg.fsdp_axis, min_bytes=cfg.min_bytes_for_fsdp,
                      data_axes=DATA_AXES)


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

    def batch(self, ndim: int) -> NamedSharding:
        """Batch leaves: dim 0 over all data axes, the rest whole."""
        return NamedSharding(self.mesh, P(DATA_AXES, *([None] * (ndim - 1))))


def opt_state_shardings(tx: optax.GradientTransformation, params_abstract: Params, param_shardings: Params,
                        replicated: NamedSharding) -> Any:
    """Optimizer state follows params: every param-shaped subtree (mu, nu) takes the param shardings, the rest
    (step counts) is replicated. optax knows which subtrees are param-shaped; shape matching would not."""
    state_abstract = jax.eval_shape(tx.init, params_abstract)
    return optax.tree_map_params(tx, lambda _, s: s, state_abstract, param_shardings,
                                 transform_non_params=lambda _: replicated)


def make_shardings(mesh: Mesh, param_shardings: Params, params_abstract: Params,
                   tx: optax.GradientTransformation, cfg: ShardingConfig) -> TrainShardings:
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
    return TrainShardings(mesh, param_shardings, stored, opt, replicated, offloaded)


def shard_batch(batch: Any, shardings: TrainShardings) -> Any:
    """Each host's local numpy batch (same shapes on every host) -> one global array per leaf.

    The global array is first assembled over *all* mesh axes flattened (a process's rows land on its own
    devices, in process order, with no transfer), then resharded to the training layout over `DATA_AXES`.
    Every leaf's dim 0 is the batch; its global size is the local size times the number of processes."""
    mesh = shardings.mesh
    n_hosts = len(trainer_processes(mesh))

    def put(x: np.ndarray) -> jax.Array:
        x = np.asarray(x)
        rest = (None,) * (x.ndim - 1)
        flat = NamedSharding(mesh, P(MESH_AXES, *rest))
        global_x = jax.make_array_from_process_local_data(flat, x, (x.shape[0] * n_hosts, *x.shape[1:]))
        return jax.device_put(global_x, shardings.batch(x.ndim))

    return jax.tree.map(put, batch)
