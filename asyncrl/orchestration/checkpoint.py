"""Trainer checkpoints with Orbax: params, optimizer state, step, RNG, weight version and data position.

Orbax writes multi-host sharded arrays with every host saving its own shards, and commits a step atomically
(it writes to a temporary directory and renames it only once complete), so a half-written checkpoint is never
taken for a good one. Only the trainer processes take part: the inference processes share the jax.distributed
job but must not be waited on, hence `active_processes`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from asyncrl.orchestration.config import CheckpointConfig

log = logging.getLogger(__name__)


class TrainerCheckpoints:
    def __init__(self, directory: str, keep: int, train_workers: int):
        self.directory = os.path.abspath(directory)
        active = set(range(train_workers))
        os.makedirs(self.directory, exist_ok=True)  # Orbax won't create it when only some processes take part
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=False,
            enable_async_checkpointing=False,  # the step loop waits anyway; sync keeps failure handling simple
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                primary_host=0, active_processes=active if jax.process_count() > train_workers else None,
                barrier_sync_key_prefix="trainer",
            ),
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any]) -> None:
        self.save_tree(step, {"params": params, "opt_state": opt_state}, meta)

    def save_tree(self, step: int, tree: Any, meta: dict[str, Any]) -> None:
        meta = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in meta.items()}
        state = jax.tree.map(_host_local_to_numpy, tree)
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )
        self.manager.wait_until_finished()
        log.debug("checkpoint %d saved to %s", step, self.directory)

    def restore(self, step: int, abstract_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Returns arrays to be placed by the caller (host-local leaves come back as NumPy)."""
        abstract_state = jax.tree.map(_numpy_target, abstract_state)
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()),
        )
        return out["state"], dict(out["meta"])

    def close(self) -> None:
        self.manager.close()


def has_checkpoint(run_dir: str) -> bool:
    d = os.path.join(run_dir, "checkpoints")
    return os.path.isdir(d) and any(x.isdigit() for x in os.listdir(d))


def open_checkpoints(cfg: CheckpointConfig, train_workers: int, run_dir: str) -> TrainerCheckpoints | None:
    """The run's checkpoints, or None when it neither saves (`checkpoint.every_n_steps`) nor resumes. Every one of
    the `train_workers` trainer hosts (`async.train_workers`) takes part."""
    if not (cfg.every_n_steps or cfg.resume):
        return None
    return TrainerCheckpoints(os.path.join(run_dir, "checkpoints"), cfg.keep, train_workers)


def resume_latest(ckpt: TrainerCheckpoints, trainer: Any) -> dict[str, Any]:
    """Load the latest checkpoint into `trainer` (params, optimizer state, counters, RNG); returns its meta (the
    data stream's state for the feeder), or {} when there is none."""
    step = ckpt.latest_step()
    if step is None:
        return {}
    state, meta = ckpt.restore(step, trainer.abstract_state())
    if meta.get("rng") is not None:  # JSON turned the key data into plain ints
        meta["rng"] = np.asarray(meta["rng"], np.uint32)
    trainer.load_state_dict(meta, state["params"], state["opt_state"])
    log.info("resumed from checkpoint step %d (data position %d, %d prompts in flight)", step,
             int(meta["position"]), len(meta.get("in_flight", [])))
    return meta


def _local_only(sharding: Any) -> bool:
    """True when a multi-process job holds this array on this process alone (a single trainer host next to
    inference hosts). Orbax refuses such "host-local" arrays in a multi-process job; they are saved as NumPy."""
    if jax.process_count() == 1 or sharding is None:
        return False
    return {d.process_index for d in sharding.device_set} == {jax.process_index()}


def _host_local_to_numpy(x: Any) -> Any:
    return np.asarray(x) if isinstance(x, jax.Array) and _local_only(x.sharding) else x


def _numpy_target(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct) and _local_only(getattr(x, "sharding", None)):
        return np.zeros(x.shape, x.dtype)
    return x
