"""The environment of the lookup task (`asyncrl/tasks/lookup.py`): the action "?" is answered with the hidden
letter; anything else is the answer, graded by the task's verifier."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncrl.rollout import StepResult, Turn
from asyncrl.tasks.lookup import ACTION, observation


class LookupEnv:
    stop: tuple[tuple[int, ...], ...] = ()

    def __init__(self, prompt_ids: Sequence[int], sample: Any, verifier: Any, timeout_s: float, tokenizer: Any):
        self.prompt_ids, self.sample, self.verifier = list(prompt_ids), sample, verifier
        self.timeout_s, self.tokenizer = timeout_s, tokenizer
        self.lookups = 0

    def reset(self) -> list[int]:
        return list(self.prompt_ids)

    def step(self, turn: Turn) -> StepResult:
        if turn.text.strip() == ACTION:
            self.lookups += 1
            if turn.last:  # no turn left to answer in
                return StepResult(None, 0.0, True, "no_answer", {"action": True})
            return StepResult(self.tokenizer.encode(observation(self.sample.answer)), 0.0, False, None,
                              {"action": True})
        score = self.verifier.submit(turn.text, self.sample).result(timeout=self.timeout_s)
        return StepResult(None, float(score.reward), True, score.reason, {"action": False})
