"""What the pipeline model (`plan/sim.py`) reports for one layout, over the steady state."""

from __future__ import annotations

from dataclasses import dataclass


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
