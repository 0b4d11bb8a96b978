"""One host of the 2-process trainer test: joins jax.distributed (gloo), trains on its local half of the batch.

Run by `tests/test_train_multiprocess.py` with XLA_FLAGS giving each process 4 fake CPU devices. Process 0 writes
the gathered params and the metrics of every step to `--out` (npz).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402


def multihost_setup() -> SimpleNamespace:
    """The run both the workers and the single-process reference train: tiny model, two steps of 8 groups x 4."""
    from asyncrl.inference.rollout import Completion
    from asyncrl.models import Model, preset
    from asyncrl.train.config import MeshConfig, ShardingConfig, TrainConfig
    from asyncrl.train.loss_config import LossConfig
    from tests.test_train_batch import make_rollouts

    model = Model(preset("tiny"))
    steps = [make_rollouts(seed, 8, 4, model.cfg.vocab_size) for seed in (0, 1)]
    # Only host 1 holds this 20-token completion, so its local batch pads to T=32 and host 0's to 16: the hosts
    # must agree on T before their rows can form one array.
    c = steps[0][-1].completions[0]
    steps[0][-1].completions[0] = Completion(
        tokens=np.resize(c.tokens, 20), logprobs=np.resize(c.logprobs, 20), forced=np.zeros(20, bool),
        versions=np.zeros(20, np.int32), reward=c.reward)
    return SimpleNamespace(
        model=model,
        train_cfg=TrainConfig(train_batch_size=32, grad_accum_steps=2, lr=1e-4, warmup_steps=1, weight_decay=0.1),
        loss_cfg=LossConfig(name="dapo"),
        sharding_cfg=ShardingConfig(mesh=MeshConfig(dp=2, fsdp=4), min_bytes_for_fsdp=0),
        steps=steps,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.num_processes,
                               process_id=args.process_id, initialization_timeout=120)
    assert jax.device_count() == 4 * args.num_processes and jax.local_device_count() == 4

    from asyncrl.train.batch import build_batch
    from asyncrl.train.trainer import Trainer

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

    full = multihost_utils.process_allgather(trainer.params, tiled=True)
    if args.process_id == 0:
        leaves = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(full)}
        np.savez(args.out, metrics=json.dumps(history), **leaves)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
