"""Configs of the async loop: roles and staleness, eval cadence, checkpoints, logging, and the run itself."""

from __future__ import annotations

import re
from dataclasses import dataclass

from asyncrl.validate import check, check_choice


@dataclass(frozen=True)
class AsyncConfig:
    train_workers: int = 1
    """Hosts (JAX processes) that train; the remaining hosts run inference. Must divide the host count."""
    max_lag: int = 1
    """Drop a group whose oldest sample was started more than this many weight versions ago."""
    admission: str = "fixed"
    """How far ahead the feeder releases prompts (`orchestration/staleness.py`). 'fixed': always max_lag versions
    ahead. 'adaptive': from on-policy, one version more per step while the trainer measures the effective sample
    size of the stalest groups' importance weights at or above `ess_target`, one less while below; max_lag stays
    the hard cap."""
    ess_target: float = 0.9
    """With admission 'adaptive': the Kish ESS fraction (pi_prox / pi_sampler over a group's model tokens) the
    stalest groups must keep for the release to reach further ahead."""
    ess_floor: float = 0.0
    """With admission 'adaptive': a group from a lag whose measured ESS is under this is dropped on arrival and
    credited like a lag drop (`rollout/filtered_ess`). 0 turns the floor off."""
    queue_timeout_s: float = 300.0
    """Longest any blocking queue get/put waits before failing with a message naming who waited for what."""
    rollout_queue_size: int = 0
    """Bound of the rollout queue in groups; 0 means 2 x prompts per step."""
    straggler_wait_s: float = 0.5
    """Once a step holds its groups, it may wait for in-flight groups that would be too stale for the next step (it
    then trains the oldest groups it holds and carries the rest), instead of leaving them to be dropped for lag.
    This is the shortest such wait, where it starts; with `straggler_wait_adaptive` it grows when stragglers are
    missed (a loaded machine, a slow host) and shrinks back as they come quickly (`staleness.StragglerWait`). 0
    takes groups as they arrive. Single trainer host only (the feeder, on rank 0, knows what is in flight)."""
    straggler_wait_adaptive: bool = True
    """Adapt the straggler wait to what it measures: doubled after a step gave up on a straggler (which is then
    dropped for lag), else 10% shorter but at least twice the longest delay a waited-for straggler took; never
    under `straggler_wait_s`, never over `straggler_wait_max_s` nor the trainer's own busy time per step (waiting
    longer than it works does not pay). False: always `straggler_wait_s`."""
    straggler_wait_max_s: float = 8.0
    """The longest the adaptive straggler wait grows to."""
    zero_variance_budget: float = 8.0
    """With `loss.filter_zero_variance` (DAPO's dynamic sampling): at most this many times a step's groups are
    dropped for zero variance per step. Past it, zero-variance groups fill the batch with zero loss weight (the step
    trains on fewer groups; `rollout/zero_variance_fillers` counts them), so a run whose prompts are mostly solved
    keeps moving instead of sampling hundreds of groups per step."""
    park_timeout_s: float = 300.0
    """Longest an inference host waits for its replicas to park for a weight sync (each parks within one decode
    chunk, `inference.decode_chunk_steps`, so this only trips on a wedged replica)."""

    def __post_init__(self) -> None:
        check("async.train_workers", self.train_workers, self.train_workers >= 1, ">= 1")
        check("async.max_lag", self.max_lag, self.max_lag >= 0, ">= 0")
        check_choice("async.admission", self.admission, ("fixed", "adaptive"))
        check("async.ess_target", self.ess_target, 0 < self.ess_target <= 1, "in (0, 1]")
        check("async.ess_floor", self.ess_floor, 0 <= self.ess_floor < self.ess_target,
              f"in [0, async.ess_target={self.ess_target})")
        check("async.queue_timeout_s", self.queue_timeout_s, self.queue_timeout_s > 0, "> 0")
        check("async.rollout_queue_size", self.rollout_queue_size, self.rollout_queue_size >= 0, ">= 0")
        check("async.park_timeout_s", self.park_timeout_s, self.park_timeout_s > 0, "> 0")
        check("async.straggler_wait_s", self.straggler_wait_s, self.straggler_wait_s >= 0, ">= 0")
        check("async.straggler_wait_max_s", self.straggler_wait_max_s,
              self.straggler_wait_max_s >= self.straggler_wait_s, f">= async.straggler_wait_s={self.straggler_wait_s}")
        check("async.zero_variance_budget", self.zero_variance_budget, self.zero_variance_budget >= 0, ">= 0")


@dataclass(frozen=True)
class EvalConfig:
    every_n_steps: int = 10
    """Run the held-out eval set every this many train steps (and before step 1 and after the last). 0 = off."""
    num_prompts: int = 32
    """Held-out prompts per eval."""
    group_size: int = 4
    """Samples per eval prompt (n of pass@k; k <= n are reported)."""

    def __post_init__(self) -> None:
        check("eval.every_n_steps", self.every_n_steps, self.every_n_steps >= 0, ">= 0")
        check("eval.num_prompts", self.num_prompts, self.num_prompts >= 1, ">= 1")
        check("eval.group_size", self.group_size, self.group_size >= 1, ">= 1")


@dataclass(frozen=True)
class CheckpointConfig:
    every_n_steps: int = 0
    """Save params, optimizer state, step, RNG and data position every this many steps. 0 = off."""
    keep: int = 2
    """How many recent checkpoints to keep."""
    resume: bool = True
    """Continue from the latest checkpoint in run_dir/checkpoints if one exists."""
    export_hf: bool = False
    """At the end, also write the final policy as a Hugging Face folder in run_dir/hf."""

    def __post_init__(self) -> None:
        check("checkpoint.every_n_steps", self.every_n_steps, self.every_n_steps >= 0, ">= 0")
        check("checkpoint.keep", self.keep, self.keep >= 1, ">= 1")


@dataclass(frozen=True)
class LoggingConfig:
    level: str = "INFO"
    """Python log level for every process. At INFO the console shows the progress, warnings, errors and a few
    one-time lines; per-step and per-sync lines (weights received, checkpoints saved) are DEBUG."""
    tensorboard: bool = True
    """Write tensorboardX events to run_dir/tb."""
    ray_metrics: bool = True
    """Export metrics as Ray Gauges (visible in the Ray dashboard)."""
    progress: bool = True
    """Show the run's progress on the driver: one live bar (step, reward, last eval, lag, tokens/s, ETA) when
    stderr is a terminal, else a plain line every `progress_every_n_steps` steps."""
    progress_every_n_steps: int = 10
    """Without a terminal (CI, `ray job logs`, a pipe): print one progress line every this many steps, and at the
    last step."""
    rollouts_every_n_steps: int = 0
    """Every this many steps, append the step's trained rollouts (text, reward, reason, per-token weight versions
    run-length encoded) to run_dir/rollouts.jsonl. 0 disables."""
    rollout_tokens: bool = False
    """The audit trail: each logged rollout also holds its prompt's token ids, and each completion its token ids,
    sampler logprobs, forced and observation marks, weight versions and turns, token for token: enough to recompute
    from rollouts.jsonl alone what the trainer scored. Needs `rollouts_every_n_steps` >= 1; about 30 bytes a
    token."""

    def __post_init__(self) -> None:
        check_choice("logging.level", self.level, ("DEBUG", "INFO", "WARNING", "ERROR"))
        check("logging.rollouts_every_n_steps", self.rollouts_every_n_steps, self.rollouts_every_n_steps >= 0, ">= 0")
        check("logging.rollout_tokens", self.rollout_tokens,
              not self.rollout_tokens or self.rollouts_every_n_steps >= 1,
              "false unless logging.rollouts_every_n_steps >= 1 (it adds to the rollouts that logs)")
        check("logging.progress_every_n_steps", self.progress_every_n_steps, self.progress_every_n_steps >= 1, ">= 1")


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    """Run name; the run directory defaults to runs/<name>."""
    run_dir: str | None = None
    """Where metrics, checkpoints, tensorboard events and plots go. None -> runs/<name>."""
    seed: int = 0
    """Seed for params init, sampling and data order."""
    hosts: int = 2
    """Simulated hosts for a local run (ignored on a real cluster, where one host = one TPU VM)."""
    devices_per_host: int = 1
    """Fake CPU devices per simulated host (run.platform gpu: GPUs per host actor)."""
    max_restarts: int = 1
    """On a dead host actor: restart all hosts from the latest checkpoint this many times, then fail."""
    platform: str = "auto"
    """'cpu' forces the CPU backend on every host; 'gpu' gives each of `hosts` host actors `devices_per_host`
    GPUs (Ray's num_gpus) on JAX's CUDA backend; 'auto' lets JAX choose (TPU when present)."""
    startup_timeout_s: float = 180.0
    """Longest the driver waits for all hosts to join jax.distributed."""
    stall_timeout_s: float = 1800.0
    """The driver dumps every host's thread stacks (to stderr and run_dir/stacks.txt) and fails the run when no
    step is published for this long (the first step includes compilation). 0 turns the detector off."""
    dashboard: bool = False
    """Local runs (no RAY_ADDRESS): start the embedded Ray cluster with its dashboard on 127.0.0.1 and print its
    URL and the Prometheus metrics URL (the `asyncrl_*` gauges, with `logging.ray_metrics`). Clusters configure
    their own dashboard (cluster/*.yaml: loopback, reached through an SSH tunnel)."""
    dashboard_port: int = 8265
    """Port of the local dashboard (`run.dashboard`)."""
    metrics_export_port: int | None = None
    """Port of the local cluster's Prometheus endpoint (http://127.0.0.1:PORT/metrics, `run.dashboard`); None lets
    Ray pick a free one (the URL is printed)."""
    tpu_topology: str | None = None
    """The TPU slice this config targets, in libtpu's naming (e.g. v5p:2x4x4 for a v5p-64): `launch.py aot`
    compiles every program for it when no --topology is given."""

    def __post_init__(self) -> None:
        check("run.hosts", self.hosts, self.hosts >= 2, ">= 2 (at least one trainer and one inference host)")
        check("run.devices_per_host", self.devices_per_host, self.devices_per_host >= 1, ">= 1")
        check("run.max_restarts", self.max_restarts, self.max_restarts >= 0, ">= 0")
        check_choice("run.platform", self.platform, ("auto", "cpu", "tpu", "gpu"))
        check("run.startup_timeout_s", self.startup_timeout_s, self.startup_timeout_s > 0, "> 0")
        check("run.stall_timeout_s", self.stall_timeout_s, self.stall_timeout_s >= 0, ">= 0 (0 = off)")
        check("run.dashboard_port", self.dashboard_port, 0 < self.dashboard_port < 65536, "a port in (0, 65536)")
        if self.metrics_export_port is not None:
            check("run.metrics_export_port", self.metrics_export_port, 0 < self.metrics_export_port < 65536,
                  "a port in (0, 65536), or null (Ray picks one)")
        if self.tpu_topology is not None:
            check("run.tpu_topology", self.tpu_topology, re.match(r"^(v5p|v6e|v5e):\d+(x\d+)+$", self.tpu_topology)
                  is not None, "a libtpu topology name such as v5p:2x4x4, v6e:2x4 or v5e:2x4")
