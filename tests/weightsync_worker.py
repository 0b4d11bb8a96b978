"""One process of the multi-process weight-sync test (run by tests/test_weight_sync.py, not by pytest)."""

import os
import sys

rank, n, port, tw, ndev = (int(a) for a in sys.argv[1:6])
bucket_mb = float(sys.argv[6]) if len(sys.argv) > 6 else 64.0
events = sys.argv[7] if len(sys.argv) > 7 else ""  # a file shared by every process: one O_APPEND line per event
delay = float(sys.argv[8]) if len(sys.argv) > 8 else 0.0
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
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


hc = HopChainTransfer(tw, bucket_mb=bucket_mb)
init = lambda k: params_lib.cast(params_lib.init_params(model.cfg, k, jnp.float32), jnp.bfloat16)  # noqa: E731
shapes = params_lib.shapes(model.cfg, jnp.bfloat16)
for round_ in range(2):  # two syncs: the second reuses the compiled hops and must deliver the new values
    if round_ == 1 and events:  # the event-order test watches the second sync, its connections already open
        hc.hop_delay_s, hc.on_event = delay, log_event
    key = jax.random.PRNGKey(round_)
    if hc.slot == 0:  # trainers: a global array over the trainer slot (spans tw processes)
        tree = jax.jit(init, out_shardings=jax.tree.map(lambda _: NamedSharding(hc.meshes[0], P()), shapes))(key)
        out, t = hc.transfer(tree)
    else:
        out, t = hc.transfer(None, shapes)
    if hc.slot == 0:  # the trainers keep their own copy; the chain returns nothing to them
        print(f"RESULT rank={rank} slot={hc.slot} round={round_} ok={out is None} bytes={int(t['weight_sync_bytes'])} "
              f"buckets={int(t['weight_sync_buckets'])}", flush=True)
        continue
    expected = jax.device_get(jax.jit(init, device=jax.local_devices()[0])(key))  # same values, computed locally
    ok = True
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
        shards = [s for s in got.addressable_shards]
        ok &= len(shards) == jax.local_device_count()
        for s in shards:
            ok &= np.asarray(s.data).dtype == want.dtype and np.array_equal(
                np.asarray(s.data).view(np.uint16), np.asarray(want).view(np.uint16))
    print(f"RESULT rank={rank} slot={hc.slot} round={round_} ok={bool(ok)} bytes={int(t['weight_sync_bytes'])} "
          f"buckets={int(t['weight_sync_buckets'])}", flush=True)
