"""Weight sync over the pipelined cross-host device_put hop chain: receivers get the trainer's cast params bit for
bit, whatever the bucket size, and the hops really overlap."""

import os
import random
import socket
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.models import params as params_lib, preset
from asyncrl.weightsync import transfer
from asyncrl.weightsync.transfer import plan_buckets
from tests.helpers import raises_within

HERE = os.path.dirname(os.path.abspath(__file__))
TINY_BYTES = 213_760  # the tiny preset in bf16 (checked below), so the bucket sizes mean what they say
SMALLER_THAN_A_LEAF = 0.001  # MB: 1000 bytes, below every leaf but the norms; cuts leaves into row ranges
LARGER_THAN_THE_MODEL = 100.0  # MB: one bucket


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(n: int, tw: int, ndev: int = 2, bucket_mb: float | str = 64.0, events: str = "", delay: float = 0.0,
         extra_env: dict | None = None) -> list[str]:
    """`n` processes of tests/weightsync_worker.py; their RESULT lines. `bucket_mb`: a size, or several joined by
    commas, each a chain of two syncs in the same launch."""
    port = _port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")} | (extra_env or {})
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "weightsync_worker.py"), str(r), str(n), str(port),
                               str(tw), str(ndev), str(bucket_mb), events, str(delay)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for r in range(n)]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=int(os.environ.get("WS_TIMEOUT", "240")))
            outs.append(out)
            assert p.returncode == 0, out[-3000:]
    finally:
        for p in procs:
            p.kill()
    return [line for o in outs for line in o.splitlines() if line.startswith("RESULT")]


def test_free_port_stays_out_of_the_ephemeral_range_and_skips_a_taken_port():
    """The transfer socket binds at the first transfer, long after its port is picked; a port from the kernel's
    ephemeral range can be taken by an outgoing connection meanwhile (CI: "bind: Address already in use")."""
    eph = transfer._ephemeral_range()
    first = transfer.free_port(rng=random.Random(7))
    lo, hi = transfer.PORT_RANGE
    if eph is None or eph[0] > lo or eph[1] < hi:  # some of the range lies outside the ephemeral one
        assert lo <= first <= hi and (eph is None or not eph[0] <= first <= eph[1])
    with socket.socket() as held:  # the same draw again, with its first pick now taken: it moves on
        held.bind(("127.0.0.1", first))
        again = transfer.free_port(rng=random.Random(7))
        assert again != first
        with socket.socket() as s:
            s.bind(("127.0.0.1", again))


def _shapes():
    return jax.tree.leaves(params_lib.shapes(preset("tiny"), jnp.bfloat16))


@pytest.mark.parametrize("bucket_mb", [0, SMALLER_THAN_A_LEAF, 0.01, 0.05, LARGER_THAN_THE_MODEL])
def test_plan_buckets_cover_every_byte_once_within_the_bound(bucket_mb):
    shapes = _shapes()
    assert sum(int(np.prod(s.shape)) * 2 for s in shapes) == TINY_BYTES
    limit = int(bucket_mb * 1e6)
    buckets = plan_buckets(shapes, limit)
    rows = {i: [] for i in range(len(shapes))}
    for b in buckets:
        assert b, "empty bucket"
        if limit > 0 and len(b) > 1:
            assert sum(p.nbytes for p in b) <= limit
        for p in b:
            rows[p.leaf].append((p.start, p.stop))
            assert p.shape[1:] == tuple(shapes[p.leaf].shape[1:]) and p.dtype == shapes[p.leaf].dtype
    for i, s in enumerate(shapes):  # consecutive row ranges that tile each leaf exactly
        n = s.shape[0] if s.shape else 1
        assert [a for a, _ in rows[i]] == [0] + [b for _, b in rows[i][:-1]] and rows[i][-1][1] == n
    if bucket_mb in (0, LARGER_THAN_THE_MODEL):
        assert len(buckets) == 1 and all(p.whole for p in buckets[0])
    if bucket_mb == SMALLER_THAN_A_LEAF:
        assert any(not p.whole for b in buckets for p in b) and len(buckets) > len(shapes)


def test_plan_buckets_keep_a_row_larger_than_the_bucket_whole():
    s = jax.ShapeDtypeStruct((3, 1000), jnp.float32)  # 4000-byte rows
    buckets = plan_buckets([s], 1000)
    assert [[(p.start, p.stop) for p in b] for b in buckets] == [[(0, 1)], [(1, 2)], [(2, 3)]]


def _check_bit_exact(n: int, tw: int, ndev: int) -> None:
    """One launch of `n` processes runs a chain at each bucket size (below a leaf, above the model), two syncs
    each: every receiver gets every byte, every slot takes part, leaves are cut into row ranges where there is
    a hop to overlap, and the trainer sends views of its own cast."""
    sizes = (SMALLER_THAN_A_LEAF, LARGER_THAN_THE_MODEL)
    results = _run(n, tw, ndev, ",".join(f"{b:g}" for b in sizes))
    assert len(results) == 2 * 2 * n, results
    assert all("ok=True" in r for r in results), results
    for bucket_mb in sizes:
        rs = [r for r in results if f" bucket_mb={bucket_mb:g} " in r]
        assert len(rs) == 2 * n, results
        # every slot took part: slot 0 (trainers) and slots 1.. (receivers)
        assert {r.split()[2] for r in rs} == {f"slot={s}" for s in range(n // tw)}
        cut = bucket_mb == SMALLER_THAN_A_LEAF and n // tw > 2  # one hop (2 slots) never cuts
        assert all(f"buckets={35 if cut else 1}" in r for r in rs), rs
        assert all("views=True" in r for r in rs if "slot=0" in r), rs  # the trainer's cast left as it was


# (3, 1, 1) is test_hop_chain_quick's, in the default suite.
@pytest.mark.slow
@pytest.mark.parametrize("n,tw,ndev", [(2, 1, 1), (4, 2, 1), (4, 1, 1), (3, 1, 2), (4, 2, 2)])
def test_hop_chain_bit_exact(n, tw, ndev):
    _check_bit_exact(n, tw, ndev)


@pytest.mark.parametrize("n,freeze_a", [(2, False), (3, False), (3, True)])
def test_lora_sync_moves_the_base_once_then_the_adapters_alone_bit_exact(n, freeze_a):
    """LoRA's payloads through the real chain, 2 and 3 processes: the first sync brings the base and the adapters
    (both bf16), the second the adapters alone (their bytes only; B alone with A frozen); both arrive bit for bit,
    and each receiver's merge of the kept base (and kept A) with the new adapters is bitwise the merge computed
    locally."""
    from asyncrl.models import lora

    results = _run(n, 1, ndev=1, bucket_mb=SMALLER_THAN_A_LEAF,
                   extra_env={"WS_LORA": "freeze_a" if freeze_a else "1"})
    assert len(results) == 2 * n and all("ok=True" in r for r in results), results
    first_bytes = 2 * lora.count(preset("tiny"), 8, tuple(lora.TARGETS))
    adapter_bytes = 2 * lora.count(preset("tiny"), 8, tuple(lora.TARGETS), ("b",) if freeze_a else ("a", "b"))
    assert all(f"bytes={TINY_BYTES + first_bytes}" in r for r in results if "round=0" in r), results
    assert all(f"bytes={adapter_bytes}" in r for r in results if "round=1" in r), results


@pytest.mark.parametrize("n,ndev", [(3, 1), (2, 2)])
def test_hop_chain_quick(n, ndev):
    """Both bucket sizes, as `test_hop_chain_bit_exact`, in the default suite. 3 x 1: a forwarding slot; with
    buckets smaller than a leaf, leaves travel cut into row ranges and are put back together bit for bit. 2 x 2:
    every slot is a 2-device mesh, so each leaf moves split in 2 shards (half on each chip, chip k to chip k), sent
    from the buffers of the trainer's own cast on a mesh of another order and shape, and every receiving chip ends
    up with it whole (one hop: a single bucket whatever bucket_mb says)."""
    _check_bit_exact(n, 1, ndev)


def test_sync_layout_splits_every_large_leaf_and_is_one_placement_on_any_mesh_of_the_same_order():
    """The layout the chain moves (`chain_sharding`): a leaf is split over all n chips along its first
    dimension after the first that n divides (row cuts along the first stay local), replicated where none does;
    on the trainer's 4-axis mesh and on a 1-D mesh of the same devices in the same order it places every shard on
    the same chip, which is what lets the trainer's cast be sent as it is."""
    from jax.sharding import AxisType, Mesh, PartitionSpec as P

    from asyncrl.sharding.chain import chain_sharding

    devs = np.array(jax.devices()[:8])[::-1]
    flat = Mesh(devs, ("devices",), axis_types=(AxisType.Explicit,))
    trainer = Mesh(devs.reshape(1, 2, 4, 1), ("dp", "fsdp", "expert", "cp"), axis_types=(AxisType.Explicit,) * 4)
    assert chain_sharding(flat, (48, 128, 2048, 768)).spec == P(None, "devices")
    assert chain_sharding(flat, (8, 12, 16)).spec == P(None, None, "devices")  # 12 does not divide by 8
    assert chain_sharding(flat, (64,)).spec == P() and chain_sharding(flat, (4, 6)).spec == P()
    for shape in [(48, 128, 2048, 768), (8, 12, 16), (36, 4096), (4, 6), (64,), ()]:
        a, b = chain_sharding(trainer, shape), chain_sharding(flat, shape)
        assert a.devices_indices_map(shape) == b.devices_indices_map(shape)
        assert a.is_equivalent_to(b, len(shape))


@pytest.mark.slow
def test_hop_chain_pipelines_buckets_over_four_receivers(tmp_path):
    """5 processes (1 trainer, 4 receivers), 8 buckets, a delay before every bucket a slot sends. Store-and-forward
    would have the last receiver hold nothing before the first receiver held everything; a pipelined chain has
    the last receiver hold bucket 0 while the trainer is still sending. Asserted on the global order of events
    (lines appended to one file), not on wall time."""
    events = str(tmp_path / "events.txt")
    bucket_mb = 0.03  # the tiny preset's 214 kB in 9 buckets
    n_b = len(plan_buckets(_shapes(), int(bucket_mb * 1e6)))
    assert n_b >= 8
    results = _run(5, 1, ndev=1, bucket_mb=bucket_mb, events=events, delay=0.3)
    assert len(results) == 10 and all("ok=True" in r for r in results), results  # 5 processes x 2 syncs
    lines = open(events).read().splitlines()
    pos = {(ln.split()[0], ln.split()[1], ln.split()[3]): k for k, ln in enumerate(lines)}
    ev = lambda kind, slot, b: pos[(kind, f"slot={slot}", f"bucket={b}")]  # noqa: E731
    for slot in range(1, 5):  # every receiver holds every bucket, in order
        assert [ev("recv", slot, b) for b in range(n_b)] == sorted(ev("recv", slot, b) for b in range(n_b))
    for slot in range(1, 4):  # each forwarder sends bucket b on only after holding it
        assert all(ev("send", slot, b) > ev("recv", slot, b) for b in range(n_b))
    # The pipelining: the last receiver held bucket 0 before the first forwarder had received the last bucket, and
    # each forwarder sent bucket 0 on before it had received the last one; store-and-forward gives the reverse order.
    # (Not compared with the trainer's own sends: nothing throttles those.)
    assert ev("recv", 4, 0) < ev("recv", 1, n_b - 1)
    for slot in range(1, 4):
        assert ev("send", slot, 0) < ev("recv", slot, n_b - 1)


ABSENT_PEER = r"""
import os, sys, time
rank, port = int(sys.argv[1]), int(sys.argv[2])
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp
jax.config.update("jax_cpu_collectives_implementation", "gloo")
from asyncrl.weightsync.transfer import HopChainTransfer, enable_cpu_transfers
enable_cpu_transfers()
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
hc = HopChainTransfer(1, timeout_s=2)
if rank == 1:  # the receiver never comes to the sync
    time.sleep(8)
    os._exit(0)
try:
    hc.transfer({"w": jax.device_put(jnp.ones(4), hc.shardings[0])})
except TimeoutError as e:
    print("ERROR", e, flush=True)
os._exit(0)
"""


def test_a_peer_missing_from_the_sync_is_a_named_timeout_not_a_hang():
    port = _port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.path.dirname(HERE)
    procs = [subprocess.Popen([sys.executable, "-c", ABSENT_PEER, str(r), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for r in range(2)]
    try:
        out = procs[0].communicate(timeout=60)[0]
        procs[1].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
    line = next((ln for ln in out.splitlines() if ln.startswith("ERROR")), out[-2000:])
    assert "weight sync #0" in line and "'weight_sync_0_start'" in line and "within 2s" in line, line


MISMATCHED_VERSION = r"""
import os, sys
rank, port = int(sys.argv[1]), int(sys.argv[2])
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp
jax.config.update("jax_cpu_collectives_implementation", "gloo")
from asyncrl.weightsync.transfer import HopChainTransfer, enable_cpu_transfers
enable_cpu_transfers()
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
hc = HopChainTransfer(1, timeout_s=2)
shapes = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
try:
    if rank == 0:  # the trainer sends version 3; the receiver was told of version 4
        hc.transfer({"w": jax.device_put(jnp.ones(4), hc.shardings[0])}, version=3)
    else:
        hc.transfer(None, shapes, version=4)
    print("RECEIVED", flush=True)
except TimeoutError as e:
    print("ERROR", e, flush=True)
# Rank 0 hosts the coordination service: leaving before rank 1 has timed out too would take rank 1 down with it
# (a fatal "another task died"), which a loaded machine made happen. Rank 1 marks when it is done.
done = sys.argv[3]
if rank == 1:
    open(done, "w").close()
else:
    import time
    t0 = time.time()
    while not os.path.exists(done) and time.time() - t0 < 45:
        time.sleep(0.05)
os._exit(0)
"""


def test_weights_are_matched_to_their_announced_version_not_to_their_order(tmp_path):
    """Each side's barriers carry the version it was told of: a receiver expecting v4 never takes v3's weights, and
    both sides time out naming the version they waited for."""
    port = _port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.path.dirname(HERE)
    procs = [subprocess.Popen([sys.executable, "-c", MISMATCHED_VERSION, str(r), str(port), str(tmp_path / "done")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for r in range(2)]
    try:
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    lines = [next((ln for ln in out.splitlines() if ln.startswith(("ERROR", "RECEIVED"))), out[-2000:]) for out in outs]
    assert "weight sync v3" in lines[0] and "'weight_sync_v3_start'" in lines[0], lines[0]
    assert "weight sync v4" in lines[1] and "'weight_sync_v4_start'" in lines[1], lines[1]


# ---- deadlines: a wedged sync and a dead sender are named, not waited on forever --------------------------------

def test_a_wedged_weight_sync_names_the_waiting_trainer():
    from asyncrl.weightsync.transfer import PendingSync

    release = threading.Event()
    pending = PendingSync(lambda: (release.wait(5), {})[1], "weight-sync-3")
    with pytest.raises(TimeoutError, match=r"trainer0 waited 0.1s for its weight sync \(weight-sync-3, the hop chain"):
        pending.wait(0.1, "trainer0")
    release.set()
    assert pending.wait(5) == {}


def test_a_hop_receive_whose_sender_died_times_out_naming_the_bucket():
    from asyncrl.weightsync.transfer import HopChainTransfer

    class NeverArrives:
        def block_until_ready(self):
            time.sleep(3600)

    hc = HopChainTransfer.__new__(HopChainTransfer)
    hc.timeout_s, hc.on_event = 0.2, None
    e = raises_within(lambda: hc._wait([NeverArrives()], "weight sync v7", 0, 1, 3), 10)
    assert isinstance(e, TimeoutError) and "weight sync v7: hop 0 (slot 0 -> slot 1" in str(e) \
        and "bucket 2/3 did not arrive within 0.2s (weightsync.timeout_s)" in str(e)

