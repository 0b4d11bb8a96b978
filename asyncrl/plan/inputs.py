"""What the pipeline model (`plan/sim.py`) is fed: what each program costs, how long the rollouts are, and how the
run is laid out. Each comes from measurements here (a run's own logs, the benchmarks) or from `launch.py aot` at
target scale; the simulator does not care which.

Program costs are affine in the work they do (a fixed part per call, a part per row or token), which is what a
roofline or a timing fit gives: a decode step of n live rows costs `a + b n` (weight-read bound on TPU: b small;
compute bound on a CPU), a prefill call of T prompt tokens `a + b T`, a train step of T tokens `a + b T`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Affine:
    """cost(x) = fixed + per_unit * x, in seconds."""

    fixed: float
    per_unit: float = 0.0

    def __call__(self, x: float) -> float:
        return self.fixed + self.per_unit * x

    @staticmethod
    def fit(xs: Sequence[float], ys: Sequence[float]) -> Affine:
        """Least squares over measured (x, seconds) points. Points that hardly vary in x (spread under half their
        mean: a train step's tokens, a full batch's rows) cannot separate the two parts, and noise then gives a
        slope of any size: their mean cost is taken as fixed. A negative part is refitted without it."""
        xs, ys = np.asarray(xs, float), np.asarray(ys, float)
        if len(xs) == 0:
            raise ValueError("Affine.fit: no points")
        if len(xs) < 3 or np.ptp(xs) < 0.5 * abs(float(np.mean(xs))):
            return Affine(float(np.mean(ys)))
        b, a = np.polyfit(xs, ys, 1)
        if b < 0:
            return Affine(float(np.mean(ys)))
        if a < 0:
            return Affine(0.0, float(np.dot(xs, ys) / np.dot(xs, xs)))
        return Affine(float(a), float(b))


@dataclass(frozen=True)
class ProgramTimes:
    """Seconds per program call, on one replica (inference) or the trainer mesh."""

    decode_step: Affine
    """One decode step of n live rows (x = n)."""
    prefill: Affine
    """One prefill call (x = its prompt tokens, padding included)."""
    train_step: Affine
    """One train step (x = the tokens it trains: prompts and completions of the step's groups)."""
    sync_cast_s: float = 0.0
    """What every sync holds the trainer for even with `weightsync.overlap`: the inference-dtype cast."""
    sync_transfer_s: float = 0.0
    """The hop chain, from the cast to the last replica holding the new weights. Replicas pause for it; the trainer
    waits for it too without overlap (and with overlap, before the next sync)."""
    verifier_s: float = 0.0
    """Per sample, off the decode thread: delays its group, costs no decode time."""
    decode_call_s: float = 0.0
    """Fixed device cost of every call of the decode program (it takes and returns the whole decode state). The
    engine substitutes one waiting row into a free slot per call (`Engine._decode_chunk`), and a call with more rows
    waiting returns after its substitution, so a replica taking in n rows makes n calls: each costs this, the last
    also its decode steps."""
    decode_call_host_s: float = 0.0
    """Host work around each decode call on the replica's thread (taking out a finished row, its verifier's
    answer, emitting the group): the engine's wall time less its device calls, per call."""
    idle_poll_s: float = 0.0
    """An idle replica blocks this long on the prompt queue per look (`InferenceWorker._next_requests`: 50 ms): a
    prompt ends the wait at once, but a sync is only seen when it runs out."""
    queue_hop_s: float = 0.0
    """One call on a Ray queue (a round trip to its actor). Every prompt pays one to be put (on the feeder's thread,
    one after another) and one to be taken (on the replica's thread, which does not decode meanwhile); every group
    one to be shipped (a thread beside decode) and one to be polled (on the trainer's thread, between its steps)."""


@dataclass(frozen=True)
class Lengths:
    """Completion lengths (tokens) to draw from, and the prompt length."""

    completions: tuple[int, ...]
    prompt: int

    def __post_init__(self) -> None:
        if not self.completions or min(self.completions) < 1:
            raise ValueError("Lengths.completions: needs at least one length, each >= 1")

    @staticmethod
    def parametric(mean: float, max_len: int, prompt: int, tail: float = 0.6, n: int = 4096,
                   seed: int = 0) -> Lengths:
        """A log-normal with that mean and log-space spread `tail` (0: every completion `mean` tokens), clipped at
        `max_len` (the budget: an overlong sample is cut there, which is the tail a run waits for)."""
        if tail <= 0:
            return Lengths((int(round(mean)),), prompt)
        mu = np.log(mean) - tail ** 2 / 2
        draws = np.random.default_rng(seed).lognormal(mu, tail, n)
        return Lengths(tuple(int(x) for x in np.clip(np.rint(draws), 1, max_len)), prompt)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.choice(np.asarray(self.completions, np.int64), size=n)

    @property
    def mean(self) -> float:
        return float(np.mean(self.completions))


@dataclass(frozen=True)
class Layout:
    """The run's shape, as the simulator sees it (the fields of the real config they stand for in comments)."""

    prompts_per_step: int  # prompts_per_step (train_batch_size / group_size)
    group_size: int  # inference.group_size
    replicas: int  # inference hosts x replicas per host
    decode_batch: int  # inference.max_decode_batch_size
    max_lag: int  # async.max_lag
    steps: int = 50
    prefill_prompts: int = 8  # inference.max_prefill_prompts: prompts per prefill call
    decode_chunk_steps: int = 64  # inference.decode_chunk_steps: the longest decode call (a sync waits for it)
    overlap: bool = True  # weightsync.overlap
    zero_variance_share: float = 0.0  # share of groups with equal rewards
    filter_zero_variance: bool = False  # loss.filter_zero_variance (DAPO: such groups are dropped)
    straggler_wait_s: float = 0.5  # async.straggler_wait_s: how long a step waits for its urgent groups
    trainer_chips: int = 1
    inference_chips: int = 1
    seed: int = 0
    skip_steps: int = 3
    """Steady-state figures leave out the first steps (the pipeline filling)."""
    shared_cores: float = 0.0
    """Cores of the one machine every process runs on (a local run: `os.cpu_count()` when it was fitted); 0: each
    host is a machine of its own, as TPU hosts are (no contention: `plan/cores.py`)."""
    trainer_cores: float = 0.0  # cores a busy trainer asks for on that machine (0: all of them)
    replica_cores: float = 0.0  # cores a busy replica asks for (0: all of them)

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "group_size", "replicas", "decode_batch", "steps", "prefill_prompts",
                     "decode_chunk_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"plan layout: {name}={getattr(self, name)} must be >= 1")
        if self.max_lag < 0:
            raise ValueError(f"plan layout: max_lag={self.max_lag} must be >= 0")
        if min(self.shared_cores, self.trainer_cores, self.replica_cores) < 0:
            raise ValueError("plan layout: shared_cores, trainer_cores and replica_cores must be >= 0")
        if not 0 <= self.zero_variance_share < 1:
            raise ValueError(f"plan layout: zero_variance_share={self.zero_variance_share} must be in [0, 1)")
