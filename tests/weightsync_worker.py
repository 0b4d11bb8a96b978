"""One process of the multi-process weight-sync test (run by tests/test_weight_sync.py, not by pytest)."""

import os
import sys

rank, n, port, tw, ndev = (int(a) for a in sys.argv[1:6])
# One or more bucket sizes, comma-separated: each is its own chain (two syncs each) in this one launch, so a test
# of several sizes pays for the processes' start, the jax.distributed join and the compilations once.
bucket_mbs = [float(x) for x in sys.argv[6].split(",")] if len(sys.argv) > 6 else [64.0]
events = sys.argv[7] if len(sys.argv) > 7 else ""  # a file shared by every process: one O_APPEND line per event
delay = float(sys.argv[8]) if len(sys.argv) > 8 else 0.0
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
from asyncrl.sharding.chain import chain_shardings  # noqa: E402
from asyncrl.sharding.roles import split_roles  # noqa: E402
from asyncrl.weightsync.transfer import HopChainTransfer, enable_cpu_transfers  # noqa: E402

enable_cpu_transfers()
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=rank)

from asyncrl.models import Model, params as params_lib, preset  # noqa: E402

model = Model(preset("tiny"))


def log_event(kind, bucket, hop):
    # One write() per line on an O_APPEND file: the file's line order is the global order of the events.
    fd = os.open(events, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{kind} slot={hc.slot} rank={rank} bucket={bucket} hop={hop}\n".encode())
    finally:
        os.close(fd)


# The trainers' mesh orders their devices otherwise than by host (reversed here, across processes when tw = 2) and
# has its own axes, as the trainer's ("dp", "fsdp", "expert", "cp") mesh does; every process is told the order.
first = split_roles(jax.devices(), tw).slots()[0][::-1]
trainer_mesh = Mesh(np.array(first).reshape(1, len(first)), ("fsdp", "expert"), axis_types=(AxisType.Explicit,) * 2)
lora_mode = os.environ.get("WS_LORA") in ("1", "freeze_a")
if lora_mode:  # LoRA's payloads (Trainer.sync_payload): the base and the adapters, then the adapters alone (B alone
    # with A frozen: the receiver merges round 0's A with round 1's B)
    from asyncrl.models import lora  # noqa: E402
    from asyncrl.orchestration.payload import SyncPayload  # noqa: E402
    from asyncrl.train.config import LoraConfig  # noqa: E402

    lcfg = LoraConfig(rank=8, alpha=16.0, freeze_a=os.environ["WS_LORA"] == "freeze_a")
    receiver = SyncPayload(model.cfg, jnp.bfloat16, lcfg)

    def make(k, full):
        ad = lora.init(model.cfg, lcfg.rank, lcfg.targets, k)
        ad = jax.tree.map(lambda x: (x + 0.01).astype(jnp.bfloat16), ad)  # B nonzero: the merge changes weights
        out = {"adapters": lora.synced(ad, full, lcfg.freeze_a)}
        if full:
            out["base"] = params_lib.cast(params_lib.init_params(model.cfg, jax.random.PRNGKey(7), jnp.float32),
                                          jnp.bfloat16)
        return out

    merge_locally = jax.jit(lambda a, b: params_lib.cast(lora.merge(b, a, lcfg.scale), jnp.bfloat16),
                            device=jax.local_devices()[0])
else:
    make = lambda k, full: params_lib.cast(params_lib.init_params(model.cfg, k, jnp.float32), jnp.bfloat16)  # noqa: E731
_compiled = {}


def compiled(where, full, **jit_kw):
    """The payload's init, jitted once per place and payload kind (dense: one kind), not once per sync: compiling
    it was most of this test's time (3-7 s a sync, beside the chain's well under a second)."""
    key = (where, full and lora_mode)
    if key not in _compiled:
        _compiled[key] = jax.jit(lambda k: make(k, full), **jit_kw)
    return _compiled[key]


for chain, bucket_mb in enumerate(bucket_mbs):
    hc = HopChainTransfer(tw, bucket_mb=bucket_mb, first_slot=first)
    for round_ in range(2):  # two syncs: the second reuses the compiled hops and must deliver the new values
        # The first chain names its syncs by their order on it (as a run without versions does); a later chain's
        # order starts at 0 again, so it names them by versions of its own: barrier names must not repeat.
        version = None if chain == 0 else 1000 * chain + round_
        if round_ == 1 and events:  # the event-order test watches the second sync, its connections already open
            hc.hop_delay_s, hc.on_event = delay, log_event
        key = jax.random.PRNGKey(round_)
        shapes = receiver.shapes(round_ == 0) if lora_mode else params_lib.shapes(model.cfg, jnp.bfloat16)
        tag = f"RESULT rank={rank} slot={hc.slot} round={round_} bucket_mb={bucket_mb:g}"
        if hc.slot == 0:  # trainers: a global array over the trainer slot (spans tw processes)
            # Dense: cast straight into the sync layout on the trainer's own mesh, as `Trainer.sync_payload` does;
            # the chain then sends views of those buffers. LoRA: replicated on the slot's mesh, which the chain
            # reshards.
            placed = jax.tree.map(lambda _: NamedSharding(hc.meshes[0], P()), shapes) if lora_mode \
                else chain_shardings(trainer_mesh, shapes)
            tree = compiled("trainers", round_ == 0, out_shardings=placed)(key)
            prep = hc.prepare(tree, version=version)
            ptrs = lambda x: {a.data.unsafe_buffer_pointer() for a in x.addressable_shards}  # noqa: E731
            leaves = jax.tree.leaves(tree)
            views = all(ptrs(x) == ptrs(leaves[p.leaf])
                        for b, xs in zip(prep.buckets, prep.pieces) for p, x in zip(b, xs) if p.whole)
            out, t = hc.run(prep)
            # the trainers keep their own copy; the chain returns nothing to them
            print(f"{tag} ok={out is None} bytes={int(t['weight_sync_bytes'])} buckets={int(t['weight_sync_buckets'])} "
                  f"views={views}", flush=True)
            continue
        out, t = hc.transfer(None, shapes, version=version)
        # the same values, computed locally
        expected = jax.device_get(compiled("local", round_ == 0, device=jax.local_devices()[0])(key))
        ok = True
        for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
            shards = [s for s in got.addressable_shards]
            ok &= len(shards) == jax.local_device_count()
            for s in shards:
                ok &= np.asarray(s.data).dtype == want.dtype and np.array_equal(
                    np.asarray(s.data).view(np.uint8), np.asarray(want).view(np.uint8))
        if lora_mode:  # the receiver's merge: the stored base (from round 0) plus the adapters just received
            merged = receiver.params(out, round_)
            made = jax.device_get(compiled("local", True, device=jax.local_devices()[0])(jax.random.PRNGKey(0)))
            ad = {f: {"a": made["adapters"][f]["a"] if lcfg.freeze_a else p["a"], "b": p["b"]}
                  for f, p in expected["adapters"].items()}
            want_merged = jax.device_get(merge_locally(ad, made["base"]))
            for got, want in zip(jax.tree.leaves(merged), jax.tree.leaves(want_merged)):
                ok &= np.array_equal(np.asarray(got.addressable_shards[0].data).view(np.uint8),
                                     np.asarray(want).view(np.uint8))
        print(f"{tag} ok={bool(ok)} bytes={int(t['weight_sync_bytes'])} buckets={int(t['weight_sync_buckets'])}",
              flush=True)
