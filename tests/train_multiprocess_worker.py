"""One host of the 2-process trainer test: joins jax.distributed (gloo), trains on its local half of the batch.

Run by `tests/test_train_multiprocess.py` with XLA_FLAGS giving each process 4 fake CPU devices. Process 0 writes
the gathered params and the metrics of every step to `--out` (npz).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hf", required=True, help="a Hugging Face folder of random_params(tiny, seed=7)")
    args = ap.parse_args()

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.num_processes,
                               process_id=args.process_id, initialization_timeout=120)
    assert jax.device_count() == 4 * args.num_processes and jax.local_device_count() == 4

    from asyncrl.train.batch import build_batch
    from asyncrl.train.trainer import Trainer
    from tests.helpers import multihost_setup

    setup = multihost_setup()
    trainer = Trainer(setup.model, setup.train_cfg, setup.loss_cfg, setup.sharding_cfg)
    trainer.init(jax.random.key(0))
    wq = trainer.params.layers.wq
    assert {s.data.shape for s in wq.addressable_shards} == {(wq.shape[0], wq.shape[1] // 4, *wq.shape[2:])}

    history = []
    for step, rollouts in enumerate(setup.steps):
        per_host = len(rollouts) // args.num_processes
        local = rollouts[args.process_id * per_host:(args.process_id + 1) * per_host]
        batch = build_batch(local, setup.loss_cfg, setup.train_cfg.pad_to_multiple)
        host = {"rollout/lag_max": float(args.process_id + step), "rollout/filtered_lag": 1.0}
        metrics = trainer.step(batch, host_metrics=host)
        metrics.pop("train/step_time_s")
        history.append(metrics)

    # Loading a Hugging Face folder onto a trainer mesh that spans both processes (what the cached format warm-start
    # and model.path do): every process reads the folder onto one of its own devices, then into the global mesh.
    from asyncrl.models import from_pretrained
    from tests.helpers import random_params

    host_params = random_params(setup.model.cfg, seed=7)
    _, local = from_pretrained(args.hf)
    assert all(d.process_index == jax.process_index() for x in jax.tree.leaves(local) for d in x.devices())
    other = Trainer(setup.model, setup.train_cfg, setup.loss_cfg, setup.sharding_cfg)
    other.load(local)
    loaded = all(np.array_equal(np.asarray(s.data), leaf[s.index])
                 for arr, leaf in zip(jax.tree.leaves(other.params), jax.tree.leaves(host_params))
                 for s in arr.addressable_shards)
    print(f"LOADED ok={loaded}", flush=True)

    full = multihost_utils.process_allgather(trainer.params, tiled=True)
    if args.process_id == 0:
        leaves = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(full)}
        np.savez(args.out, metrics=json.dumps(history), **leaves)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
