"""Weight sync as a pipelined chain of cross-host `jax.device_put` hops inside the shared jax.distributed job.

Hosts are cut into `n_slots = hosts / train_workers` equal slots of consecutive ranks; slot 0 holds the trainers.
Each slot gets a 1-D mesh over its devices (slot 0's in the trainer mesh's order, `first_slot`), and every leaf
travels split over it (`chain_sharding`): each hop moves the model's bytes once, chip i to chip i, and no
trainer chip ever holds the whole model. After the last hop each receiving slot gathers its leaves whole onto
every one of its chips (the replicas take zero-copy views of them, `inference/weights.py`). Slot i sends to slot
i+1 for i = 0..n_slots-2. This is the blog's `RDMATransferServer`; on TPU the hops ride ICI, on CPU the DCN
transfer path (needs `jax_cross_host_transfer_socket_address`, see `enable_cpu_transfers`).

Pipelining. The parameters are cut into buckets of about `bucket_mb` (`plan_buckets`: whole leaves packed in
order; a leaf larger than a bucket is cut along its first axis, the stacked layer axis, into row ranges). The hops
run as a wavefront: at tick t, hop i moves bucket t - i. A forwarding slot has already enqueued the receive of
bucket b+1 when it blocks on bucket b and sends it on, so every hop works at once and the chain costs about one
whole transfer plus (n_slots - 2) buckets, instead of n_slots - 1 whole transfers in a row. `bucket_mb=0` sends
the whole tree as one bucket (store-and-forward, the pre-pipelining behaviour), and so does a chain of one hop.

Every process runs every hop in the same order, like any multi-host JAX computation: a process in the sending
slot passes its real arrays, the others an empty stand-in of the same abstract value, and the receiving slot gets
the materialized arrays. So all processes call `transfer` (or `prepare` + `run`) together.

The two barriers around the chain use the jax.distributed coordination service, not a device collective
(`multihost_utils.sync_global_devices`): on the CPU backend with 2+ devices per process, a gloo all-gather issued
while a sender's device_puts are in flight deadlocks (its gloo context setup times out). The key-value barrier
has no such interaction and needs no compilation. Both have a timeout; inside the chain there is no barrier, and a
hop that fails (the cross-host transfer has its own timeout) raises an error naming the hop and the bucket.

Overlap. `prepare` does the part that may launch computations on the trainer mesh (reshard to the sync layout
where the sender's arrays are not in it already, cut the buckets), and must run on the thread that runs the train
step, so that every trainer process issues its collectives in the same order. `run`, the barriers and hops, may
then run on a background thread (`start`): the trainer trains its next step while its previous weights travel.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax._src import distributed
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from asyncrl.sharding.chain import chain_sharding
from asyncrl.sharding.roles import split_roles
from asyncrl.weightsync.layout import Piece, concat_rows, plan_buckets, take_rows

# Where `free_port` looks: above Ray's worker ports (10002-19999 by default) and below Linux's ephemeral range
# (32768-60999 by default; macOS starts at 49152).
PORT_RANGE = (20000, 32767)


def _ephemeral_range() -> tuple[int, int] | None:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return None


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port that is free now, outside the kernel's ephemeral range where it can be.

    The CPU transfer server binds its socket lazily, at the first cross-host transfer, often a minute after the
    port was picked. A port from `bind(host, 0)` comes from the ephemeral range, which every outgoing connection
    (Ray opens many) also draws from, so by then one of those may hold it ("bind: Address already in use", seen
    in CI). Outgoing connections never take a port outside that range, so a random free one there stays free
    unless another listener picks the very same port."""
    rng = rng or random.Random()
    lo, hi = PORT_RANGE
    eph = _ephemeral_range()
    candidates = [p for p in range(lo, hi + 1) if eph is None or not eph[0] <= p <= eph[1]]
    for port in rng.sample(candidates, min(64, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the ephemeral range covers everything (or all 64 were taken): the kernel picks
        s.bind((host, 0))
        return s.getsockname()[1]


def enable_cpu_transfers(host: str = "127.0.0.1") -> None:
    """CPU backends refuse cross-host device_put unless each process names a socket for it (FACTS.md).
    Must run before the first transfer."""
    jax.config.update("jax_cross_host_transfer_socket_address", f"{host}:{free_port(host)}")


def barrier(name: str, timeout_s: float = 600.0, what: str = "") -> None:
    """Every process waits at `name` (unique per use) via the coordination service. There is no public API for
    this; orbax's `multihost.sync_global_processes` uses the same client call."""
    client = distributed.global_state.client
    if client is None:
        if jax.process_count() == 1:
            return
        raise RuntimeError("jax.distributed is not initialized; the hop chain needs it")
    try:
        client.wait_at_barrier(name, int(timeout_s * 1000))
    except Exception as e:  # the client raises a bare XlaRuntimeError (DEADLINE_EXCEEDED or a dead peer)
        raise TimeoutError(f"{what or name}: not every process reached barrier {name!r} within {timeout_s:g}s "
                           f"(process {jax.process_index()}): {e}") from e


def slot_mesh(devices: np.ndarray) -> Mesh:
    """A slot's 1-D mesh: the hop chain moves each leaf split over it (`chain_sharding`)."""
    return Mesh(devices, ("devices",), axis_types=(AxisType.Explicit,))


# ------------------------------------------------------------------------------------------------ the chain


@dataclass
class Prepared:
    """One sync, ready to run: its tag, this slot's pieces per bucket (slot 0) and the flat structure."""

    index: int
    tag: str  # names the sync's barriers: every process of one sync must agree on it
    treedef: Any
    shapes: list[jax.ShapeDtypeStruct]
    buckets: list[list[Piece]]
    pieces: list[list[jax.Array]] | None
    t0: float
    prepare_s: float


class PendingSync:
    """A sync running on a background thread. `wait()` returns its timings or raises its error."""

    def __init__(self, target: Callable[[], dict[str, float]], name: str):
        self._result: dict[str, float] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(target,), name=name, daemon=True)
        self._thread.start()

    def _run(self, target: Callable[[], dict[str, float]]) -> None:
        try:
            self._result = target()
        except BaseException as e:  # noqa: BLE001 - re-raised on the waiting thread
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout_s: float | None = None, who: str = "the trainer") -> dict[str, float]:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"{who} waited {timeout_s:g}s for its weight sync ({self._thread.name}, the hop chain "
                               "to every inference host) to finish; a receiving host is wedged")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def _ready_within(tree: Any, timeout_s: float) -> Any:
    """`jax.block_until_ready(tree)` with a deadline: a receive whose sender died can block forever, so the wait
    runs on a helper thread (a daemon: left behind only when the host is failing anyway)."""
    box: dict[str, Any] = {}

    def wait() -> None:
        try:
            box["out"] = jax.block_until_ready(tree)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    t = threading.Thread(target=wait, name="weight-sync-receive", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"not ready within {timeout_s:g}s")
    if "error" in box:
        raise box["error"]
    return box["out"]


class HopChainTransfer:
    def __init__(self, train_workers: int, devices: Sequence[jax.Device] | None = None, *, bucket_mb: float = 512.0,
                 timeout_s: float = 600.0, hop_delay_s: float = 0.0,
                 on_event: Callable[[str, int, int], None] | None = None,
                 first_slot: Sequence[jax.Device] | None = None):
        """`devices`: every device of the job (default `jax.devices()`), split into slots by `split_roles`.
        `bucket_mb`: pipelining granularity (0 = one bucket). `timeout_s`: the start/end barriers' timeout.
        `first_slot`: slot 0's devices in the trainer mesh's order (`trainer.mesh.devices.flat`; default: by host
        and id), so that the trainer's cast, made in the sync layout on its own mesh, is already the first hop's
        input (no reshard). Every process must pass the same order: a receiver pairs shard k with the sender's
        k-th chip. `hop_delay_s` and `on_event(kind, bucket, hop)` ("send" before a bucket leaves this slot,
        "recv" once a bucket is held here) exist for tests that show the pipelining by the order of events."""
        split = split_roles(jax.devices() if devices is None else devices, train_workers)
        self.train_workers = train_workers
        self.slots = [np.array(s) for s in split.slots()]
        if first_slot is not None:
            first = list(first_slot)
            if len(first) != len(self.slots[0]) or set(first) != set(self.slots[0]):
                raise ValueError(f"first_slot ({len(first)} devices) must order the trainer hosts' "
                                 f"{len(self.slots[0])} devices, and only them")
            self.slots[0] = np.array(first)
        self.n_slots = len(self.slots)
        self.slot_size = len(self.slots[0])
        self.meshes = [slot_mesh(d) for d in self.slots]
        self.shardings = [NamedSharding(m, P()) for m in self.meshes]  # what a receiving slot delivers: whole leaves
        self.slot = jax.process_index() // train_workers
        self.bucket_bytes = int(bucket_mb * 1e6)
        self.timeout_s = timeout_s
        self.hop_delay_s = hop_delay_s
        self.on_event = on_event
        self.transfers = 0

    # ---- public ---------------------------------------------------------------------------------------------

    def transfer(self, tree: Any, shapes: Any | None = None, version: int | None = None
                 ) -> tuple[Any, dict[str, float]]:
        """Trainers pass their params (any sharding on the trainer mesh); the others pass None and `shapes` (a
        ShapeDtypeStruct tree). Returns (the received tree, or None on the trainers' slot 0, timings). `version`
        (see `prepare`) names the sync."""
        return self.run(self.prepare(tree, shapes, version))

    def start(self, tree: Any, on_done: Callable[[], None] | None = None, version: int | None = None
              ) -> PendingSync:
        """A trainer's sync that runs behind its next step: `prepare` here, the chain on a background thread.
        `tree` is the trainer's own inference-dtype copy; it stays alive until the sync is done."""
        prep = self.prepare(tree, version=version)

        def target() -> dict[str, float]:
            _, m = self.run(prep)
            if on_done is not None:
                on_done()
            return m

        return PendingSync(target, f"weight-sync-{prep.index}")

    def prepare(self, tree: Any, shapes: Any | None = None, version: int | None = None) -> Prepared:
        """The part of a sync that may launch computations on the trainer mesh. Call it on the train-step thread.

        `version`: the weight version this sync carries. Its barriers are named after it, so the sender and every
        receiver must name the same version (a mismatch times out, naming both); without it, syncs are told
        apart by their order on this object."""
        t0 = time.perf_counter()
        if shapes is None:
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
        flat, treedef = jax.tree.flatten(shapes)
        # One hop has nothing to overlap: cutting leaves would only add copies on both ends.
        buckets = plan_buckets(flat, self.bucket_bytes if self.n_slots > 2 else 0)
        pieces = None
        if self.slot == 0:
            leaves = [self._in_layout(x) for x in jax.tree.leaves(tree)]
            pieces = [[leaves[p.leaf] if p.whole else take_rows(leaves[p.leaf], p.start, p.stop) for p in b]
                      for b in buckets]
        index = self.transfers
        self.transfers += 1
        tag = f"weight_sync_{index}" if version is None else f"weight_sync_v{version}"
        return Prepared(index, tag, treedef, flat, buckets, pieces, t0, time.perf_counter() - t0)

    def run(self, prep: Prepared) -> tuple[Any, dict[str, float]]:
        """The collective chain: start barrier, the wavefront of hops, end barrier. Any thread."""
        tag = prep.tag
        label = tag.removeprefix("weight_sync_")
        what = f"weight sync {label if label.startswith('v') else '#' + label}"
        t0 = time.perf_counter()
        barrier(tag + "_start", self.timeout_s, what)
        t1 = time.perf_counter()
        held = self._chain(prep, what)
        if self.slot > 0:
            held = [self._wait(h, what, self.slot - 1, b, len(held), event=False) for b, h in enumerate(held)]
        t2 = time.perf_counter()
        barrier(tag + "_end", self.timeout_s, what)
        out = None if self.slot == 0 else self._assemble(prep, held)
        nbytes = sum(p.nbytes for b in prep.buckets for p in b)
        return out, {"weight_sync_s": time.perf_counter() - prep.t0, "weight_sync_barrier_s": t1 - t0,
                     "weight_sync_hops_s": t2 - t1, "weight_sync_prepare_s": prep.prepare_s,
                     "weight_sync_bytes": float(nbytes), "weight_sync_buckets": float(len(prep.buckets))}

    # ---- internals ------------------------------------------------------------------------------------------

    def _in_layout(self, x: jax.Array) -> jax.Array:
        """A sender's leaf on slot 0's mesh in the sync layout: a view of its buffers where it is laid out so
        already (the trainer's cast, on a mesh of the same device order), else resharded (a computation on the
        trainer chips)."""
        s = chain_sharding(self.meshes[0], x.shape)
        if isinstance(x, jax.Array) and x.sharding.devices_indices_map(x.shape) == s.devices_indices_map(x.shape):
            return jax.make_array_from_single_device_arrays(x.shape, s, [a.data for a in x.addressable_shards])
        return jax.device_put(x, s)

    def _empty(self, p: Piece, slot: int) -> jax.Array:
        return jax.make_array_from_single_device_arrays(p.shape, chain_sharding(self.meshes[slot], p.shape), [],
                                                        dtype=p.dtype)

    def _chain(self, prep: Prepared, what: str) -> list[Any]:
        """Tick t: hop i (slot i -> i+1) moves bucket t - i. A slot s > 0 blocks on bucket t - s, which it
        received at tick t - 1, only after enqueuing the receive of bucket t - s + 1, and then sends it on."""
        n_b, hops = len(prep.buckets), self.n_slots - 1
        held: list[Any] = list(prep.pieces) if self.slot == 0 else [None] * n_b
        for t in range(n_b + hops):
            for i in range(hops + 1):  # i == hops: only the last slot's wait for its bucket t - hops
                b = t - i
                if not 0 <= b < n_b:
                    continue
                # The last slot forwards nothing: it waits bucket by bucket only when someone watches the events.
                if self.slot == i and i > 0 and (i < hops or self.on_event is not None):
                    held[b] = self._wait(held[b], what, i - 1, b, n_b)
                if i == hops:
                    continue
                if self.slot == i:
                    if self.hop_delay_s:
                        time.sleep(self.hop_delay_s)
                    if self.on_event is not None:
                        self.on_event("send", b, i)
                    src = held[b]
                else:
                    src = [self._empty(p, i) for p in prep.buckets[b]]
                # Same layout on both ends (a cross-host device_put cannot reshard): chip k sends to chip k.
                moved = jax.device_put(src, [chain_sharding(self.meshes[i + 1], p.shape) for p in prep.buckets[b]])
                if self.slot == i + 1:
                    held[b] = moved
        return held

    def _wait(self, bucket: list[jax.Array], what: str, hop: int, b: int, n_b: int, event: bool = True
              ) -> list[jax.Array]:
        where = f"hop {hop} (slot {hop} -> slot {hop + 1}, process {jax.process_index()} receiving)"
        try:
            out = _ready_within(bucket, self.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{what}: {where}: bucket {b + 1}/{n_b} did not arrive within {self.timeout_s:g}s "
                               "(weightsync.timeout_s); the sending host is dead or wedged") from None
        except Exception as e:
            raise RuntimeError(f"{what}: {where} failed on bucket {b + 1}/{n_b}: {e}") from e
        if event and self.on_event is not None:
            self.on_event("recv", b, hop)
        return out

    def _assemble(self, prep: Prepared, held: list[Any]) -> Any:
        """Leaves back from their pieces (a cut leaf is concatenated once, on this slot's mesh), then gathered
        whole onto every chip of the slot (a collective over the slot's hosts; after the end barrier, when no
        transfer is in flight)."""
        parts: list[list[jax.Array]] = [[] for _ in prep.shapes]
        for bucket, arrays in zip(prep.buckets, held):
            for p, x in zip(bucket, arrays):
                parts[p.leaf].append(x)
        leaves = [ps[0] if len(ps) == 1 else concat_rows(*ps) for ps in parts]
        whole = jax.device_put(leaves, self.shardings[self.slot])
        try:  # a collective over the slot's hosts: a peer that died after the end barrier would block it forever
            whole = _ready_within(whole, self.timeout_s)
        except TimeoutError as e:
            raise TimeoutError(f"weight sync: slot {self.slot}'s gather of the received weights: {e} "
                               "(weightsync.timeout_s); a host of the slot is gone") from None
        return jax.tree.unflatten(prep.treedef, whole)
