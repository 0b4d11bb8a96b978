"""Weight sync as a chain of cross-host `jax.device_put` hops inside the shared jax.distributed job.

Hosts are cut into `n_slots = hosts / train_workers` equal slots of consecutive ranks; slot 0 holds the trainers.
Each slot gets a 1-D mesh over its devices. The trainer puts its (cast) tree replicated on slot 0's mesh, then
slot i sends to slot i+1 for i = 0..n_slots-2. Every process runs every hop: a process in the sending slot passes
its real arrays, the others pass an empty stand-in of the same abstract value, and the receiving slot gets the
materialized arrays. `device_put` is asynchronous, so all leaves of all hops are enqueued and pipelined; the
more leaves, the more sends overlap. This is the blog's `RDMATransferServer`; on TPU the hops ride ICI, on CPU
the DCN transfer path (needs `jax_cross_host_transfer_socket_address`, see `enable_cpu_transfers`).

All processes must call `transfer` together (it is a collective), like any multi-host JAX computation.

The barriers around the hops use the jax.distributed coordination service, not a device collective
(`multihost_utils.sync_global_devices`): on the CPU backend with 2+ devices per process, a gloo all-gather
issued while a sender's device_puts are still in flight deadlocks (the sender returns from `device_put` at once,
enters the collective, and its gloo context setup times out). The key-value barrier has no such interaction, and
is cheaper: no compilation, no device work.
"""

from __future__ import annotations

import itertools
import socket
import time
from typing import Any, Sequence

import jax
import numpy as np
from jax._src import distributed
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from asyncrl.sharding.roles import split_roles


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def enable_cpu_transfers(host: str = "127.0.0.1") -> None:
    """CPU backends refuse cross-host device_put unless each process names a socket for it (FACTS.md).
    Must run before the first transfer."""
    jax.config.update("jax_cross_host_transfer_socket_address", f"{host}:{free_port()}")


def barrier(name: str, timeout_s: float = 600.0) -> None:
    """Every process waits at `name` (unique per use) via the coordination service. There is no public API for
    this; orbax's `multihost.sync_global_processes` uses the same client call."""
    client = distributed.global_state.client
    if client is None:
        if jax.process_count() == 1:
            return
        raise RuntimeError("jax.distributed is not initialized; the hop chain needs it")
    client.wait_at_barrier(name, int(timeout_s * 1000))


def slot_mesh(devices: np.ndarray) -> Mesh:
    """A slot's 1-D mesh: the hop chain moves each leaf replicated over it."""
    return Mesh(devices, ("devices",), axis_types=(AxisType.Explicit,))


class HopChainTransfer:
    def __init__(self, train_workers: int, devices: Sequence[jax.Device] | None = None):
        """`devices`: every device of the job (default `jax.devices()`), split into slots by `split_roles`."""
        split = split_roles(jax.devices() if devices is None else devices, train_workers)
        self.train_workers = train_workers
        self.slots = [np.array(s) for s in split.slots()]
        self.n_slots = len(self.slots)
        self.slot_size = len(self.slots[0])
        self.meshes = [slot_mesh(d) for d in self.slots]
        self.shardings = [NamedSharding(m, P()) for m in self.meshes]
        self.slot = jax.process_index() // train_workers
        self.transfers = 0

    def transfer(self, tree: Any, shapes: Any | None = None) -> tuple[Any, dict[str, float]]:
        """Trainers pass their params (any sharding on the trainer mesh); the others pass None and `shapes` (a
        ShapeDtypeStruct tree). Returns (this slot's materialized tree, timings)."""
        t0 = time.perf_counter()
        tag = f"weight_sync_{self.transfers}"
        barrier(tag + "_start")
        t1 = time.perf_counter()
        if shapes is None:
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
        if self.slot == 0:
            tree = jax.device_put(tree, self.shardings[0])
        out = tree if self.slot == 0 else None
        for i, (src, dst) in enumerate(itertools.pairwise(self.shardings)):
            buffer = out if self.slot == i else jax.tree.map(
                lambda s, sh=src: jax.make_array_from_single_device_arrays(s.shape, sh, [], dtype=s.dtype), shapes
            )
            moved = jax.device_put(buffer, dst)
            if self.slot == i + 1:
                # A forwarding slot holds its copy before sending it on.
                out = jax.block_until_ready(moved) if i + 2 < self.n_slots else moved
        out = jax.block_until_ready(out)
        t2 = time.perf_counter()
        barrier(tag + "_end")
        self.transfers += 1
        nbytes = sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes))
        return out, {"weight_sync_s": time.perf_counter() - t0, "weight_sync_barrier_s": t1 - t0,
                     "weight_sync_hops_s": t2 - t1, "weight_sync_bytes": float(nbytes)}
