"""The trainer role (the blog's AsyncTrainWorker): feed prompts, collect rollouts within max_lag, train, sync.

Staleness is controlled at both ends. The feeder (rank 0) releases prompts for step s only once the trainer's
weight version is at least s - max_lag (plus credit for dropped groups), so inference never runs far ahead; the
collector drops any group older than max_lag anyway. With max_lag=0 this is exactly on-policy and deterministic
(samples are seeded per prompt position), which is what makes resume-equals-uninterrupted testable.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.orchestration.checkpoint import TrainerCheckpoints
from asyncrl.orchestration.metrics import RayGauges
from asyncrl.sharding.roles import split_roles
from asyncrl.tasks import build_task, summarize_rewards

log = logging.getLogger(__name__)


@dataclass
class PromptItem:
    """What travels on the prompt queues: the task sample, its data position (seeds its samples), and n."""

    position: int
    sample: Any
    n: int
    is_eval: bool = False
    eval_round: int = -1


class TrainerWorker:
    def __init__(self, cfg: Any, rank: int, run_dir: str, queues: dict[str, Any]):
        self.cfg, self.rank, self.run_dir = cfg, rank, run_dir
        t = cfg.async_.queue_timeout_s
        self.q = {k: v.as_role(f"trainer{rank}", t) for k, v in queues.items()}
        self.tw = cfg.async_.train_workers
        self.inference_hosts = jax.process_count() - self.tw
        self.P = cfg.prompts_per_step
        self.stop = threading.Event()
        self.dropped = 0
        self.position = 0  # next train data position
        self.synced_version = -1  # the version the inference hosts hold (the feeder gates on this, not on the
        # trainer's own version, so no prompt is released between a step and the sync of its weights)

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
            self.position, self.dropped = int(meta["position"]), int(meta.get("dropped", 0))
            log.info("resumed from checkpoint step %d (data position %d)", step, self.position)
        self.transfer = HopChainTransfer(self.tw, jax.devices())
        self.infer_dtype = jnp.dtype(cfg.inference.params_dtype)
        self.task = build_task(cfg.task) if self.rank == 0 else None
        self._eval_samples: list | None = None
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

    def _log_rollouts(self, step: int, version: int, rollouts: list) -> None:
        """One JSON line per trained group. Each trainer host writes its own share of the batch to its own file
        (rollouts.jsonl, rollouts.rank1.jsonl, ...), so nothing is gathered over the network for logging."""
        name = "rollouts.jsonl" if self.rank == 0 else f"rollouts.rank{self.rank}.jsonl"
        with open(os.path.join(self.run_dir, name), "a") as f:
            for r in rollouts:
                f.write(json.dumps({
                    "step": step, "trainer_version": version, "id": r.sample[2].id, "position": r.sample[0],
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
        _, m = self.transfer.transfer(params)
        del params
        self.synced_version = self.trainer.version
        m["weight_sync_s"] = time.perf_counter() - t0
        return m

    # ---- prompt feeding (rank 0) ----------------------------------------------------------------------------

    def _allowed(self) -> int:
        slack = self.P if self.cfg.async_.max_lag > 0 else 0
        return self.P * (self.synced_version + self.cfg.async_.max_lag + 1) + self.dropped + slack

    def _feed(self) -> None:
        it = self.task.samples("train", self.cfg.task.seed)
        for _ in itertools.islice(it, self.position):  # resume: skip what earlier runs consumed
            pass
        try:
            while not self.stop.is_set():
                if self.position >= self._allowed():
                    time.sleep(0.02)
                    continue
                sample = next(it)
                item = PromptItem(self.position, sample, self.cfg.inference.group_size)
                while not self.stop.is_set():
                    try:
                        self.q["prompt"].put(item, timeout=1.0)
                        break
                    except TimeoutError:
                        continue
                self.position += 1
        except BaseException as e:  # surfaced by the step loop
            self.feed_error = e

    # ---- eval (rank 0) --------------------------------------------------------------------------------------

    def launch_eval(self, round_: int) -> int:
        e = self.cfg.eval
        if self._eval_samples is None:  # the same held-out prompts every round
            self._eval_samples = list(itertools.islice(self.task.samples("eval", self.cfg.task.seed), e.num_prompts))
        samples = self._eval_samples
        for i, s in enumerate(samples):
            self.q["eval_prompt"].put(PromptItem(1_000_000_000 + i, s, e.group_size, True, round_))
        return len(samples)

    def collect_eval(self, n: int, round_: int, timeout: float) -> dict[str, float]:
        groups, deadline = [], time.time() + timeout
        while len(groups) < n:
            r = self.q["eval_rollout"].poll(max(0.1, min(1.0, deadline - time.time())))
            if r is None:
                if time.time() > deadline:
                    raise TimeoutError(f"trainer0 waited {timeout:.0f}s for eval round {round_} "
                                       f"({len(groups)}/{n} groups) on the 'eval_rollout' queue")
                continue
            if r.sample[1] == round_:
                groups.append(r)
        groups.sort(key=lambda g: g.sample[0])  # eval-set order
        # Every eval sample, for inspection and for paired comparisons of two evals (same prompts, same order).
        with open(os.path.join(self.run_dir, "eval_samples.jsonl"), "a") as f:
            for g in groups:
                f.write(json.dumps({"round": round_, "version": g.oldest_version, "id": g.sample[2].id,
                                    "answer": g.sample[2].answer,
                                    "completions": [{"text": c.text, "reward": c.reward, "reason": c.reason}
                                                    for c in g.completions]}) + "\n")
        stats = summarize_rewards([list(g.rewards) for g in groups])
        out = {f"eval/{k}": float(v) for k, v in stats.items()}
        out["eval/reward_mean"] = float(np.mean([g.rewards.mean() for g in groups]))
        out["eval/version"] = float(min(g.oldest_version for g in groups))
        out["eval/prompts"] = float(len(groups))
        out["eval/samples"] = float(sum(len(g.completions) for g in groups))
        return out

    # ---- main loop ------------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from asyncrl.train.batch import build_batch, collect_rollouts

        self._build()
        cfg, tr = self.cfg, self.trainer
        log.info("trainer %d ready: version %d, %d inference hosts", self.rank, tr.version, self.inference_hosts)
        sync_m = self.sync_weights()  # inference starts from exactly the trainer's weights
        self.feed_error: BaseException | None = None
        if self.rank == 0:
            threading.Thread(target=self._feed, name="prompt-feeder", daemon=True).start()
        evals_every = cfg.eval.every_n_steps
        pending_eval: tuple[int, int, int] | None = None  # (round, n, launched at step)
        if self.rank == 0 and evals_every and tr.step_count == 0:
            pending_eval = (0, self.launch_eval(0), 0)
        total = cfg.train.total_steps
        last_row: dict[str, Any] = {}
        while tr.step_count < total:
            step = tr.step_count + 1
            t0 = time.perf_counter()
            rollouts, host_m = collect_rollouts(
                lambda t: self.q["rollout"].poll(t), self.P // self.tw, tr.version, cfg.async_.max_lag,
                cfg.loss.filter_zero_variance, cfg.async_.queue_timeout_s, who=f"trainer{self.rank}",
            )
            if self.feed_error is not None:
                raise self.feed_error
            rollouts.sort(key=lambda r: r.sample[0])  # by data position: same batch order whatever arrived first
            batch = build_batch(rollouts, tr.version, cfg.loss, cfg.train.pad_to_multiple)
            every = cfg.logging.rollouts_every_n_steps
            if every and step % every == 0:
                self._log_rollouts(step, tr.version, rollouts)
            metrics = tr.step(batch, host_m)
            self.dropped += int(metrics.get("rollout/filtered_lag", 0) + metrics.get("rollout/filtered_zero_variance", 0))
            sync_m = self.sync_weights()
            n_tokens = float(np.asarray(batch.seq_lens).sum()) * self.tw
            row: dict[str, Any] = {"step": step, **metrics, **sync_m, "weight_version": tr.version,
                                   "train/tokens_per_s": n_tokens / max(metrics.get("train/step_time_s", 1e-9), 1e-9),
                                   "step_time_s": time.perf_counter() - t0}
            if self.rank == 0:
                row |= self._inference_metrics()
                if pending_eval is not None and self.q["eval_rollout"].qsize() >= pending_eval[1]:
                    row |= self.collect_eval(pending_eval[1], pending_eval[0], cfg.async_.queue_timeout_s)
                    row["eval/at_step"] = pending_eval[2]
                    pending_eval = None
                if evals_every and step % evals_every == 0 and step < total and pending_eval is None:
                    pending_eval = (step, self.launch_eval(step), step)
            if step == total:
                self.stop.set()  # no more train prompts: inference capacity goes to the final eval
            if self.rank == 0:
                if step == total and evals_every:  # the final eval, on the final weights
                    if pending_eval is not None:
                        self.collect_eval(pending_eval[1], pending_eval[0], cfg.async_.queue_timeout_s)
                    row |= self.collect_eval(self.launch_eval(step), step, cfg.async_.queue_timeout_s)
                    row["eval/at_step"] = step
                if self.gauges is not None:
                    self.gauges.set(row)
                self.q["driver"].put(row)
            # After the metrics row: a checkpoint must never exist for a step whose row was not yet published
            # (a resume would then skip that row); the reverse is harmless (the driver drops rows past it).
            if self.ckpt is not None and cfg.checkpoint.every_n_steps and step % cfg.checkpoint.every_n_steps == 0:
                self.ckpt.save(step, tr.params, tr.opt_state, {**tr.state_dict(), "position": self._consumed(),
                                                               "dropped": self.dropped})
            last_row = row
        self.stop.set()
        if self.ckpt is not None:
            self.ckpt.close()
        if cfg.checkpoint.export_hf:
            self._export()
        return {"steps": tr.step_count, "version": tr.version, "last": {k: v for k, v in last_row.items()
                                                                         if isinstance(v, (int, float))}}

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

    def _consumed(self) -> int:
        """Data position to resume from: every prompt released so far has been trained on or dropped, except
        those still queued or in flight, which a resumed run regenerates (same positions, same samples)."""
        return self.P * self.trainer.step_count + self.dropped if self.cfg.async_.max_lag == 0 else self.position

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
