"""The trainer role (the blog's AsyncTrainWorker): the loop that joins the jobs of a trainer host. Each job lives
in its own module: building the trainer and resuming (`trainer_setup.py`, `checkpoint.py`), feeding prompts
(`feeder.py`), evals (`evals.py`), collecting a step's groups (`collect.py`), logging them (`rollout_log.py`),
metrics (`metrics.py`) and the final Hugging Face export (`export.py`). Here: collect, train, sync, publish,
checkpoint.

Staleness is controlled at both ends by one rule (`staleness.py`): the feeder (rank 0) releases the prompts of a
step only once inference holds weights recent enough, and the collector drops any group too stale anyway, and
credits every drop to the feeder at once. With max_lag=0 this is exactly on-policy and deterministic (samples are
seeded per prompt position), which is what makes resume-equals-uninterrupted testable; at any max_lag a resume
regenerates the prompts that were in flight.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.envs import build_task
from asyncrl.orchestration import faults, jsonl
from asyncrl.orchestration.collect import collect_rollouts
from asyncrl.orchestration.evals import Evals
from asyncrl.orchestration.export import export_hf
from asyncrl.orchestration.feeder import Feeder
from asyncrl.orchestration.messages import GroupConsumed, WeightSync
from asyncrl.orchestration.metrics import RayGauges, inference_means
from asyncrl.orchestration.role_config import TrainerRoleConfig
from asyncrl.orchestration.rollout_log import drop_record, log_rollouts, rollouts_path
from asyncrl.orchestration.staleness import Admission, Staleness, StragglerWait
from asyncrl.orchestration.trainer_setup import build_trainer
from asyncrl.train.ess import COUNT, W_SQ_SUM, W_SUM, group_staleness, kish_ess, lag_means, lag_sums

log = logging.getLogger(__name__)


class TrainerWorker:
    def __init__(self, cfg: TrainerRoleConfig, rank: int, run_dir: str, queues: dict[str, Any]):
        self.cfg, self.rank, self.run_dir = cfg, rank, run_dir
        t = cfg.async_.queue_timeout_s
        self.q = {k: v.as_role(f"trainer{rank}", t) for k, v in queues.items()}
        self.tw = cfg.async_.train_workers
        self.inference_hosts = jax.process_count() - self.tw
        self.P = cfg.prompts_per_step
        a = cfg.async_
        admission = Admission(a.max_lag, a.ess_target, a.ess_floor) if a.admission == "adaptive" else None
        self.staleness = Staleness(a.max_lag, admission)
        self.straggler = StragglerWait(a.straggler_wait_s, a.straggler_wait_max_s, a.straggler_wait_adaptive)
        # Tool metrics have a fixed key set on every host of a run whose tasks use tools (combined by position).
        self.tool_metrics = any(src.tools for src in cfg.task.sources)
        self.agent_metrics = any(src.environment == "agent" for src in cfg.task.sources)
        self.stop = threading.Event()
        self.feeder: Feeder | None = None
        self.evals: Evals | None = None
        self._resume_meta: dict[str, Any] = {}
        self._sync: Any = None  # the weight sync in flight (weightsync.overlap), a transfer.PendingSync
        self._synced = 0  # syncs started by this attempt
        self._sync_m: dict[str, float] = {}  # the timings of the last sync that finished
        self._eval_blocked_s = 0.0  # this step's wait for its own sync before launching an eval round

    # ---- setup ----------------------------------------------------------------------------------------------

    def _build(self) -> None:
        from asyncrl.weightsync.transfer import HopChainTransfer

        cfg = self.cfg
        self.trainer, self.ckpt, self._resume_meta = build_trainer(cfg, self.run_dir)
        if self.staleness.admission is not None and "admission" in self._resume_meta:
            self.staleness.admission.restore(self._resume_meta["admission"])  # every host: each collector drops
        ws = cfg.weightsync
        self.transfer = HopChainTransfer(self.tw, jax.devices(), bucket_mb=ws.bucket_mb, timeout_s=ws.timeout_s,
                                         first_slot=self.trainer.mesh.devices.flat)
        self.infer_dtype = jnp.dtype(cfg.params_dtype)
        if self.rank == 0:
            self._build_feeder_and_evals()
        self.gauges = RayGauges(cfg.run_name) if (cfg.logging.ray_metrics and self.rank == 0) else None

    # ---- weight sync ----------------------------------------------------------------------------------------

    def sync_weights(self, wait: bool = False) -> dict[str, float]:
        """Cast, signal every inference host, then start the collective hop chain. With `weightsync.overlap` the
        chain runs on a background thread behind the next step: this waits only for the previous sync (and, with
        `wait`, for this one). The cast copy is a separate buffer from the train state, which the next step
        donates, and lives until its sync is done: the double buffer. Returns the timings of the last finished
        sync and `weight_sync/trainer_blocked_s`, the time this call held the trainer."""
        t0 = time.perf_counter()
        self._await_sync()
        # With LoRA, the first sync of the attempt carries the base too; later ones the adapters alone.
        full = self._synced == 0
        params = self.trainer.sync_payload(self.infer_dtype, full)
        self._synced += 1
        if self.rank == 0:
            for _ in range(self.inference_hosts):
                self.q["weight_sync"].put(WeightSync(self.trainer.version, full))
        faults.point("weight_sync", self.rank, self.trainer.step_count, self.run_dir)
        version, feeder = self.trainer.version, self.feeder
        # The feeder gates on the version inference holds, not the trainer's own: credited when the chain is done.
        self._sync = self.transfer.start(params, (lambda: feeder.set_synced(version)) if feeder is not None else None,
                                         version=version)
        del params
        if wait or not self.cfg.weightsync.overlap:
            self._await_sync()
        return {**self._sync_m, "weight_sync/trainer_blocked_s": time.perf_counter() - t0}

    def _await_sync(self) -> float:
        """Wait for the sync in flight, if any; returns the seconds waited."""
        if self._sync is None:
            return 0.0
        t0 = time.perf_counter()
        ws = self.cfg.weightsync
        self._sync_m = self._sync.wait(2 * ws.timeout_s + 60, f"trainer{self.rank}")  # barriers and hops time out first
        self._sync = None
        return time.perf_counter() - t0

    # ---- prompt feeding and evals (rank 0) ------------------------------------------------------------------

    def _build_feeder_and_evals(self) -> None:
        cfg, t = self.cfg, self.cfg.async_.queue_timeout_s
        task = build_task(cfg.task)
        remote = self.q["consumed"].drain if self.tw > 1 else None
        self.feeder = Feeder(lambda: task.samples("train", cfg.task.seed),
                             lambda item, to: self.q["prompt"].put(item, to),
                             prompts_per_step=self.P, staleness=self.staleness, group_size=cfg.group_size,
                             oversample=cfg.loss.filter_zero_variance,
                             drain_remote=remote, timeout_s=t, who=f"trainer{self.rank}")
        if self._resume_meta:
            self.feeder.restore(self._resume_meta)
        self.evals = Evals(lambda: task.samples("eval", cfg.task.seed), cfg.eval.num_prompts, cfg.eval.group_size,
                           self.run_dir, put=lambda item, to: self.q["eval_prompt"].put(item, to),
                           poll=self.q["eval_rollout"].poll, qsize=self.q["eval_rollout"].qsize, timeout_s=t,
                           who=f"trainer{self.rank}")

    def _on_consumed(self, step: int, drops: list) -> Any:
        """The collector's callback: credit the feeder at once (directly on rank 0, by queue from the others)."""
        def on(rollout: Any, reason: str | None) -> None:
            position = rollout.prompt.position
            if reason is not None:
                drops.append(drop_record(step, rollout, reason))
            if self.feeder is not None:
                self.feeder.consumed(position, reason)
            else:
                self.q["consumed"].put(GroupConsumed(position, reason, self.rank))
        return on

    def _check(self) -> None:
        if self.feeder is not None:
            self.feeder.check()

    # ---- main loop ------------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from asyncrl.train.batch import build_batch

        self._build()
        cfg, tr = self.cfg, self.trainer
        log.info("trainer %d ready: version %d, %d inference hosts", self.rank, tr.version, self.inference_hosts)
        sync_m = self.sync_weights(wait=True)  # inference starts from exactly the trainer's weights
        if self.feeder is not None:
            self.feeder.start()
        evals_every = cfg.eval.every_n_steps
        if self.evals is not None and evals_every and tr.step_count == 0:
            self.evals.launch(0, 0)
        total = cfg.train.total_steps
        last_row: dict[str, Any] = {}
        pool: list = []  # groups received but not trained yet (collect.py: oldest first)
        # Waiting for the oldest in-flight groups needs to know them all: the feeder does, on a single trainer
        # host. With several, each host's share arrives on a shared queue, so hosts take what reaches them.
        urgent = None
        if cfg.async_.straggler_wait_s > 0 and self.feeder is not None and self.tw == 1:
            urgent = self.feeder.urgent
        try:
            while tr.step_count < total:
                step = tr.step_count + 1
                faults.point("step", self.rank, step, self.run_dir)
                t0 = time.perf_counter()
                drops: list[dict[str, Any]] = []
                rollouts, host_m = collect_rollouts(
                    lambda t: self.q["rollout"].poll(t), self.P // self.tw, tr.version, self.staleness,
                    cfg.loss.filter_zero_variance, cfg.async_.queue_timeout_s, who=f"trainer{self.rank}",
                    on_consumed=self._on_consumed(step, drops), check=self._check, pool=pool, urgent=urgent,
                    zero_variance_budget=int(np.ceil(cfg.async_.zero_variance_budget * (self.P // self.tw))),
                    straggler=self.straggler, tools=self.tool_metrics, agents=self.agent_metrics,
                )
                # By data position: the same batch order whatever arrived first.
                rollouts.sort(key=lambda r: r.prompt.position)
                batch = build_batch(rollouts, cfg.loss, cfg.train.pad_to_multiple, group_rows=cfg.group_rows)
                every = cfg.logging.rollouts_every_n_steps
                if every and step % every == 0:
                    log_rollouts(rollouts_path(self.run_dir, self.rank), step, tr.version, rollouts, drops,
                                 tokens=cfg.logging.rollout_tokens)
                version = tr.version
                metrics = tr.step(batch, host_m)
                metrics |= self._measure_staleness(step, version, rollouts, int(batch.tokens.shape[0]))
                sync_m = self.sync_weights()
                real = np.asarray(batch.group_ids) >= 0  # filler rows (kept agent branches) are not trained tokens
                n_tokens = float(np.asarray(batch.seq_lens)[real].sum()) * self.tw
                step_s = max(metrics.get("train/step_time_s", 1e-9), 1e-9)
                row: dict[str, Any] = {"step": step, **metrics, **sync_m, "weight_version": tr.version,
                                       "train/tokens_per_s": n_tokens / step_s,
                                       "step_time_s": time.perf_counter() - t0, "time": time.time()}
                # The straggler wait is bounded by the trainer's busy time per step (staleness.StragglerWait).
                self.straggler.note_busy(row["step_time_s"] - host_m["rollout/queue_wait_s_max"])
                if step == total:
                    self.stop.set()
                    if self.feeder is not None:  # no more train prompts: inference goes to the final eval
                        self.feeder.stop.set()
                if self.rank == 0:
                    reports = self.q["inference_metrics"].drain()
                    jsonl.append(os.path.join(self.run_dir, "inference.jsonl"),
                                 ({"host": m.host, **m.counters} for m in reports if m.counters))
                    row |= inference_means(reports)
                    if self.evals is not None:
                        self._eval_blocked_s = 0.0
                        row |= self.evals.at_step(step, total, evals_every, before_launch=self._await_sync_for_eval)
                        row["weight_sync/trainer_blocked_s"] += self._eval_blocked_s
                    if self.gauges is not None:
                        self.gauges.set(row)
                    self.q["driver"].put(row)
                # After the metrics row: a checkpoint must never exist for a step whose row was not yet published
                # (a resume would then skip that row); the reverse is harmless (the driver drops rows past it).
                if self.ckpt is not None and cfg.checkpoint.every_n_steps and step % cfg.checkpoint.every_n_steps == 0:
                    self.ckpt.save(step, tr.params, tr.opt_state, {**tr.state_dict(), **self._feeder_state()})
                last_row = row
        finally:
            self.stop.set()
            if self.feeder is not None:
                self.feeder.stop.set()
        self._await_sync()  # the last weights reach inference before the hosts are torn down
        if self.ckpt is not None:
            self.ckpt.close()
        if cfg.checkpoint.export_hf:
            export_hf(cfg.model, tr, self.run_dir, self.rank)
        return {"steps": tr.step_count, "version": tr.version, "last": {k: v for k, v in last_row.items()
                                                                         if isinstance(v, (int, float))}}

    def _await_sync_for_eval(self) -> None:
        """An eval round at step k runs with the weights of step k: their sync must have landed first."""
        self._eval_blocked_s += self._await_sync()

    def _feeder_state(self) -> dict[str, Any]:
        """Checkpoint meta of the data stream (the same on every trainer host: only rank 0 has a feeder, but the
        primary host writes the meta)."""
        if self.feeder is None:
            return {}
        self.feeder.drain_remote()  # every host's consumption up to this step is queued by now (the step is collective)
        admission = {} if self.staleness.admission is None else {"admission": self.staleness.admission.state()}
        return {**self.feeder.state(), **admission}

    def _measure_staleness(self, step: int, version: int, rollouts: list, local_rows: int) -> dict[str, float]:
        """The trained groups' ESS and k3 from the step's proximal pass, by lag (`train/ess.py`), combined over the
        trainer hosts (a collective: every host calls it); adaptive admission follows them (`staleness.py`)."""
        tr, max_lag = self.trainer, self.cfg.async_.max_lag
        offset = tr.group_offset(local_rows)
        ess, k3 = group_staleness(tr.group_weights[offset:offset + len(rollouts)])
        sums = lag_sums(ess, k3, [self.staleness.lag(version, r) for r in rollouts], max_lag)
        row, by_lag = lag_means(tr.combine_host_metrics(sums), max_lag)
        total = tr.group_weights.astype(np.float64).sum(0)
        row["staleness/batch_ess"] = float(kish_ess(total[W_SUM], total[W_SQ_SUM], total[COUNT]))
        if self.staleness.admission is not None:
            self.staleness.admission.observe(step, by_lag)
        row["admission/ahead"] = float(self.staleness.ahead)
        return row
