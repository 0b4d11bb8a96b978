"""What the pipeline model (`plan/sim.py`) reports for one layout, over the steady state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Result:
    steps: int
    step_s: float
    """Mean wall time per step over the steady state."""
    step_s_all: list
    trainer_busy: float
    """Share of the steady wall time the trainer spends in train steps."""
    sync_blocked_s: float
    """Per step: time the trainer waits on weight syncs (casts, and chains it has to wait for)."""
    inference_busy: float
    """Share of the steady wall time the replicas spend in decode and prefill calls."""
    decode_occupancy: float
    """Live rows / decode batch, averaged over decode time."""
    slot_busy_time: float
    """Live rows x time / (decode batch x wall time x replicas): the slots' share of the wall time holding a row."""
    dropped_lag: int
    dropped_zero_variance: int
    generated_tokens_per_s_per_chip: float
    trained_tokens_per_s_per_chip: float
    lag_mean: float

    def row(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "step_s_all"}


def steady_state(sim: Any) -> Result:
    """The figures of a finished `plan.sim.Simulation` over its steady state (its first `skip_steps` steps left
    out)."""
    ends = sim.step_ends
    k = min(sim.lay.skip_steps, len(ends) - 2) if len(ends) > 2 else 0
    w0, w1 = (ends[k - 1] if k > 0 else 0.0), ends[-1]
    span = max(w1 - w0, 1e-12)
    n_steps = len(ends) - k

    def overlap(a: float, b: float) -> float:
        return max(0.0, min(b, w1) - max(a, w0))

    train = sum(overlap(a, b) for a, b in sim.train_spans)
    blocked = sum(overlap(a, b) for a, b in sim.blocked)
    busy = decode_t = slot = 0.0
    for r in sim.replicas:
        for a, b, kind, live in r.calls:
            o = overlap(a, b)
            busy += o if kind in ("decode", "prefill", "insert") else 0.0
            if kind == "decode":
                decode_t += o
                slot += o * live
    steady = [x for x in sim.trained_tokens if x[0] > w0]
    chips = sim.lay.trainer_chips + sim.lay.inference_chips
    return Result(
        steps=len(ends), step_s=span / n_steps, step_s_all=list(np.diff([0.0, *ends])),
        trainer_busy=train / span, sync_blocked_s=blocked / n_steps,
        inference_busy=busy / (span * len(sim.replicas)),
        decode_occupancy=slot / max(decode_t * sim.lay.decode_batch, 1e-12),
        slot_busy_time=slot / (span * sim.lay.decode_batch * len(sim.replicas)),
        dropped_lag=sim.dropped_lag, dropped_zero_variance=sim.dropped_zv,
        generated_tokens_per_s_per_chip=sum(x[2] for x in steady) / span / chips,
        trained_tokens_per_s_per_chip=sum(x[1] for x in steady) / span / chips,
        lag_mean=float(np.mean(sim.lags)) if sim.lags else 0.0)
