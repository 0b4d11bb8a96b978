"""A single-turn task as a one-step environment: the prompt opens the episode, the model answers once, and the
task's verifier grades the answer (in its sandboxed worker pool). The single-turn path of a run is this, not a
second rollout path beside the multi-turn one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncrl.rollout import StepResult, Turn


class SingleTurnEnv:
    def __init__(self, prompt_ids: Sequence[int], sample: Any, verifier: Any, timeout_s: float):
        """`verifier`: a `tasks.Verifier` (its `submit` returns a future of a Score); `timeout_s`: how long the
        step waits for the grade before it fails (the engine then ends the episode with reward 0)."""
        self.prompt_ids, self.sample, self.verifier, self.timeout_s = list(prompt_ids), sample, verifier, timeout_s

    def reset(self) -> list[int]:
        return list(self.prompt_ids)

    def step(self, turn: Turn) -> StepResult:
        try:
            score = self.verifier.submit(turn.text, self.sample).result(timeout=self.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"the verifier gave no score for {self.sample.id} within {self.timeout_s:g}s "
                               "(4 x task.verifier.timeout_s + 30); the verifier pool is stalled") from None
        return StepResult(None, float(score.reward), True, score.reason)
