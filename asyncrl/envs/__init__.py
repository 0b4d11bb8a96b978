"""Environments: what a completion is sampled in (the protocol: `asyncrl/rollout.py`, `Environment`).

`Environments` opens, for each prompt, one environment per sample of its group, by the name its task gives
(`Task.environment_for`): 'single_turn' (the answer graded once by the task's verifier) or a multi-turn one.
"""

from __future__ import annotations

from typing import Any, Callable

from asyncrl.envs.lookup import LookupEnv
from asyncrl.envs.single_turn import SingleTurnEnv

EnvFactory = Callable[..., Any]
"""(prompt ids, sample, verifier, step timeout, tokenizer) -> an environment."""

_REGISTRY: dict[str, EnvFactory] = {
    "single_turn": lambda ids, sample, verifier, timeout_s, tokenizer: SingleTurnEnv(ids, sample, verifier, timeout_s),
    "lookup": LookupEnv,
}


def register_environment(name: str, factory: EnvFactory) -> None:
    if name in _REGISTRY and _REGISTRY[name] is not factory:
        raise ValueError(f"environment {name!r} is already registered")
    _REGISTRY[name] = factory


def registered_environments() -> list[str]:
    return sorted(_REGISTRY)


class Environments:
    """Opens the episodes of a run's prompts: `open(sample, n) -> (prompt ids, n environments)`."""

    def __init__(self, task: Any, tokenizer: Any, verifier: Any, *, chat: bool, step_timeout_s: float):
        self.task, self.tokenizer, self.verifier, self.chat = task, tokenizer, verifier, chat
        self.step_timeout_s = step_timeout_s

    def stop_sequences(self) -> list[tuple[int, ...]]:
        """The stop sequences of every environment the task may use (each factory's `stop`: texts, encoded with
        the run's tokenizer, or token ids): the engine's decode program compiles them in and ends any row's turn on
        one, so they are the union over the run."""
        seqs = set()
        for name in sorted(self.task.environments()):
            for q in getattr(_REGISTRY.get(name), "stop", ()):
                ids = self.tokenizer.encode(q) if isinstance(q, str) else [int(t) for t in q]
                if ids:
                    seqs.add(tuple(ids))
        return sorted(seqs)

    def open(self, sample: Any, n: int) -> tuple[list[int], list[Any]]:
        name = self.task.environment_for(sample)
        if name not in _REGISTRY:
            raise ValueError(f"task sample {sample.id} names environment {name!r}; registered: {sorted(_REGISTRY)}")
        ids = self.tokenizer.encode_prompt(sample.prompt, chat=self.chat)
        envs = [_REGISTRY[name](ids, sample, self.verifier, self.step_timeout_s, self.tokenizer) for _ in range(n)]
        opened = [env.reset() for env in envs]
        if any(list(o) != list(opened[0]) for o in opened[1:]):
            raise ValueError(f"the environments of {sample.id} open differently; a group's samples must share "
                             "their prompt")
        return list(opened[0]), envs
