"""The trainer role (the blog's AsyncTrainWorker): collect rollouts within max_lag, train, sync, checkpoint.

Staleness is controlled at both ends. The feeder (rank 0, `feeder.py`) releases the prompts of step s only once
the inference hosts hold version s - 1 - max_lag, so inference never runs further ahead than max_lag allows; the
collector drops any group older than max_lag anyway, and credits every drop to the feeder at once. With
max_lag=0 this is exactly on-policy and deterministic (samples are seeded per prompt position), which is what
makes resume-equals-uninterrupted testable; at any max_lag a resume regenerates the prompts that were in flight.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.orchestration import faults
from asyncrl.orchestration.checkpoint import TrainerCheckpoints
from asyncrl.orchestration.evals import Evals
from asyncrl.orchestration.feeder import Feeder, PromptItem  # noqa: F401  (PromptItem: the prompt queues' items)
from asyncrl.orchestration.metrics import RayGauges
from asyncrl.sharding.roles import split_roles
from asyncrl.tasks import build_task

log = logging.getLogger(__name__)


class TrainerWorker:
    def __init__(self, cfg: Any, rank: int, run_dir: str, queues: dict[str, Any]):
        self.cfg, self.rank, self.run_dir = cfg, rank, run_dir
        t = cfg.async_.queue_timeout_s
        self.q = {k: v.as_role(f"trainer{rank}", t) for k, v in queues.items()}
        self.tw = cfg.async_.train_workers
        self.inference_hosts = jax.process_count() - self.tw
        self.P = cfg.prompts_per_step
        self.stop = threading.Event()
        self.feeder: Feeder | None = None
        self.evals: Evals | None = None
        self._resume_meta: dict[str, Any] = {}

    # ---- setup ----------------------------------------------------------------------------------------------

    def _build(self) -> None:
        from asyncrl.models.sources import load_model, model_config
        from asyncrl.models.transformer import Model
        from asyncrl.train.trainer import Trainer
        from asyncrl.weightsync.transfer import HopChainTransfer

        cfg = self.cfg
        roles = split_roles(jax.devices(), self.tw)
        model = Model(model_config(cfg.model))
        self.trainer = Trainer(model, cfg.train, cfg.loss, cfg.sharding, devices=roles.trainer_devices,
                               temperature=cfg.inference.temperature)
        key = jax.random.PRNGKey(cfg.run.seed)
        if cfg.model.path or cfg.model.source:
            _, params = load_model(cfg.model, key)
            self.trainer.load(params)
            self.trainer.rng = jax.random.key(cfg.run.seed)
        else:
            self.trainer.init(key)
        resuming = cfg.checkpoint.resume and os.path.isdir(os.path.join(self.run_dir, "checkpoints")) and any(
            x.isdigit() for x in os.listdir(os.path.join(self.run_dir, "checkpoints")))
        if cfg.train.format_warmstart_steps and not resuming:
            self._warmstart(model)
        self.ckpt = TrainerCheckpoints(os.path.join(self.run_dir, "checkpoints"), cfg.checkpoint.keep, self.tw) \
            if cfg.checkpoint.every_n_steps or cfg.checkpoint.resume else None
        if self.ckpt is not None and cfg.checkpoint.resume and self.ckpt.latest_step() is not None:
            step = self.ckpt.latest_step()
            state, meta = self.ckpt.restore(step, self.trainer.abstract_state())
            if meta.get("rng") is not None:  # JSON turned the key data into plain ints
                meta["rng"] = np.asarray(meta["rng"], np.uint32)
            self.trainer.load_state_dict(meta, state["params"], state["opt_state"])
            self._resume_meta = meta
            log.info("resumed from checkpoint step %d (data position %d, %d prompts in flight)", step,
                     int(meta["position"]), len(meta.get("in_flight", [])))
        self.transfer = HopChainTransfer(self.tw, jax.devices())
        self.infer_dtype = jnp.dtype(cfg.inference.params_dtype)
        if self.rank == 0:
            self._build_feeder_and_evals()
        self.gauges = RayGauges(cfg.run.name) if (cfg.logging.ray_metrics and self.rank == 0) else None

    def _warmstart(self, model: Any) -> None:
        from asyncrl.models.sources import cache_dir, load_tokenizer
        from asyncrl.train.warmstart import cached_format_warmstart

        cfg = self.cfg
        # Every trainer host computes the same thing (same seed, same data), so no broadcast is needed.
        params = cached_format_warmstart(
            model, self.trainer.params_for_inference(jnp.float32), load_tokenizer(cfg.model, self.run_dir),
            build_task(cfg.task), cfg.task, cfg.train.format_warmstart_steps, cache_dir(), cfg.run.seed,
            chat=cfg.task.prompt_template == "chat", lr=cfg.train.format_warmstart_lr,
            batch=cfg.train.format_warmstart_batch, source=repr(cfg.model))
        rng = self.trainer.rng
        self.trainer.load(params)
        self.trainer.rng = rng

    def _log_rollouts(self, step: int, version: int, rollouts: list, drops: list) -> None:
        """One JSON line per trained group, and one per group dropped while collecting for this step. Each trainer
        host writes its own share to its own file (rollouts.jsonl, rollouts.rank1.jsonl, ...), so nothing is
        gathered over the network for logging."""
        name = "rollouts.jsonl" if self.rank == 0 else f"rollouts.rank{self.rank}.jsonl"
        with open(os.path.join(self.run_dir, name), "a") as f:
            for d in drops:
                f.write(json.dumps(d) + "\n")
            for r in rollouts:
                f.write(json.dumps({
                    "step": step, "trainer_version": version, "pid": os.getpid(), "id": r.prompt.id,
                    "position": r.prompt.position,
                    "worker": r.worker,
                    "completions": [{
                        "text": c.text, "reward": c.reward, "reason": c.reason, "finish": c.finish_reason,
                        "n_tokens": int(len(c.tokens)),
                        # [[first token index, version], ...]: one entry per run of equal versions
                        "versions": [[0, c.start_version], *map(list, c.version_boundaries)] if len(c.tokens) else [],
                    } for c in r.completions]}) + "\n")

    # ---- weight sync ----------------------------------------------------------------------------------------

    def sync_weights(self) -> dict[str, float]:
        """Cast, signal every inference host, then run the collective hop chain."""
        t0 = time.perf_counter()
        params = self.trainer.params_for_inference(self.infer_dtype)
        if self.rank == 0:
            for _ in range(self.inference_hosts):
                self.q["weight_sync"].put({"version": self.trainer.version})
        faults.point("weight_sync", self.rank, self.trainer.step_count, self.run_dir)
        _, m = self.transfer.transfer(params)
        del params
        if self.feeder is not None:  # gate on the version inference holds, not the trainer's own
            self.feeder.set_synced(self.trainer.version)
        m["weight_sync_s"] = time.perf_counter() - t0
        return m

    # ---- prompt feeding and evals (rank 0) ------------------------------------------------------------------

    def _build_feeder_and_evals(self) -> None:
        cfg, t = self.cfg, self.cfg.async_.queue_timeout_s
        task = build_task(cfg.task)
        remote = self.q["consumed"].drain if self.tw > 1 else None
        self.feeder = Feeder(lambda: task.samples("train", cfg.task.seed), lambda item, to: self.q["prompt"].put(item, to),
                             prompts_per_step=self.P, max_lag=cfg.async_.max_lag, group_size=cfg.inference.group_size,
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
                drops.append({"step": step, "pid": os.getpid(), "dropped": reason, "position": position,
                              "id": rollout.prompt.id,
                              "oldest_version": rollout.oldest_version})
            if self.feeder is not None:
                self.feeder.consumed(position, reason)
            else:
                self.q["consumed"].put((position, reason))
        return on

    def _check(self) -> None:
        if self.feeder is not None:
            self.feeder.check()

    # ---- main loop ------------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from asyncrl.train.batch import build_batch
        from asyncrl.train.collect import collect_rollouts

        self._build()
        cfg, tr = self.cfg, self.trainer
        log.info("trainer %d ready: version %d, %d inference hosts", self.rank, tr.version, self.inference_hosts)
        sync_m = self.sync_weights()  # inference starts from exactly the trainer's weights
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
            urgent = lambda: self.feeder.urgent(tr.version)  # noqa: E731
        try:
            while tr.step_count < total:
                step = tr.step_count + 1
                faults.point("step", self.rank, step, self.run_dir)
                t0 = time.perf_counter()
                drops: list[dict[str, Any]] = []
                rollouts, host_m = collect_rollouts(
                    lambda t: self.q["rollout"].poll(t), self.P // self.tw, tr.version, cfg.async_.max_lag,
                    cfg.loss.filter_zero_variance, cfg.async_.queue_timeout_s, who=f"trainer{self.rank}",
                    on_consumed=self._on_consumed(step, drops), check=self._check, pool=pool, urgent=urgent,
                    zero_variance_budget=int(np.ceil(cfg.async_.zero_variance_budget * (self.P // self.tw))),
                    straggler_wait_s=cfg.async_.straggler_wait_s,
                )
                rollouts.sort(key=lambda r: r.prompt.position)  # by data position: same batch order whatever arrived first
                batch = build_batch(rollouts, cfg.loss, cfg.train.pad_to_multiple)
                every = cfg.logging.rollouts_every_n_steps
                if every and step % every == 0:
                    self._log_rollouts(step, tr.version, rollouts, drops)
                metrics = tr.step(batch, host_m)
                sync_m = self.sync_weights()
                n_tokens = float(np.asarray(batch.seq_lens).sum()) * self.tw
                row: dict[str, Any] = {"step": step, **metrics, **sync_m, "weight_version": tr.version,
                                       "train/tokens_per_s": n_tokens / max(metrics.get("train/step_time_s", 1e-9), 1e-9),
                                       "step_time_s": time.perf_counter() - t0}
                if step == total:
                    self.stop.set()
                    if self.feeder is not None:  # no more train prompts: inference goes to the final eval
                        self.feeder.stop.set()
                if self.rank == 0:
                    row |= self._inference_metrics()
                    row |= self._evals_at(step, total, evals_every)
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
        if self.ckpt is not None:
            self.ckpt.close()
        if cfg.checkpoint.export_hf:
            self._export()
        return {"steps": tr.step_count, "version": tr.version, "last": {k: v for k, v in last_row.items()
                                                                         if isinstance(v, (int, float))}}

    def _evals_at(self, step: int, total: int, every: int) -> dict[str, Any]:
        """The eval metrics this step's row carries: a round that came back is collected, the next is launched;
        at the final step the pending round is waited for and recorded, then the final eval runs."""
        ev, out = self.evals, {}
        if ev is None or not every:
            return out
        if step == total:
            if ev.pending is not None:
                ev.collect()  # recorded in evals.jsonl; the final row carries the final eval
            ev.launch(step, step)
            return ev.collect()
        if ev.ready():
            out = ev.collect()
        if step % every == 0 and ev.pending is None:
            ev.launch(step, step)
        return out

    def _feeder_state(self) -> dict[str, Any]:
        """Checkpoint meta of the data stream (the same on every trainer host: only rank 0 has a feeder, but the
        primary host writes the meta)."""
        if self.feeder is None:
            return {}
        self.feeder.drain_remote()  # every host's consumption up to this step is queued by now (the step is collective)
        return self.feeder.state()

    def _export(self) -> None:
        """The final policy as a Hugging Face folder (run_dir/hf) that transformers and vLLM read."""
        from asyncrl.models import save_pretrained
        from asyncrl.models.sources import load_tokenizer, resolve_path

        out = os.path.join(self.run_dir, "hf")
        save_pretrained(self.trainer.model, self.trainer.params, out)  # collective over the trainer mesh
        if self.rank == 0:
            src = self.cfg.model.tokenizer or resolve_path(self.cfg.model)
            if src is None:  # presets train with the character tokenizer built in the run dir
                load_tokenizer(self.cfg.model, self.run_dir)
                src = os.path.join(self.run_dir, "char_tokenizer")
            for f in os.listdir(src):
                if f.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
                    shutil.copy(os.path.join(src, f), os.path.join(out, f))
            log.info("exported the final policy to %s", out)

    def _inference_metrics(self) -> dict[str, float]:
        rows = self.q["inference_metrics"].drain()
        if not rows:
            return {}
        out: dict[str, float] = {}
        for key in rows[0]:
            vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
            if vals:
                out[f"inference/{key}"] = float(np.mean(vals)) if not key.endswith("_max") else float(max(vals))
        return out
