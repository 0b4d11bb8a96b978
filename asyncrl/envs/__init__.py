"""Environments: what a completion is sampled in (the protocol: `asyncrl/rollout.py`, `Environment`).

`Environments` opens, for each prompt, one environment per sample of its group, by the name its task gives
(`Task.environment_for`): 'single_turn' (the answer graded once by the task's verifier), 'tools' (turns that call
the configured tools until the model answers), or another multi-turn one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from asyncrl.envs.lookup import LookupEnv
from asyncrl.envs.single_turn import SingleTurnEnv
from asyncrl.envs.textarena import TextArenaEnv
from asyncrl.envs.tool_use import Toolbox, ToolEnv
from asyncrl.tools.config import ToolsConfig

EnvFactory = Callable[..., Any]
"""(prompt ids, sample, verifier, step timeout, tokenizer) -> an environment. A factory with `needs_toolbox` also
gets the process's `Toolbox` (keyword `toolbox`)."""

_REGISTRY: dict[str, EnvFactory] = {
    "single_turn": lambda ids, sample, verifier, timeout_s, tokenizer: SingleTurnEnv(ids, sample, verifier, timeout_s),
    "lookup": LookupEnv,
    "tools": ToolEnv,
    "textarena": TextArenaEnv,  # text games (optional package: imported when a game opens)
}


def register_environment(name: str, factory: EnvFactory) -> None:
    if name in _REGISTRY and _REGISTRY[name] is not factory:
        raise ValueError(f"environment {name!r} is already registered")
    _REGISTRY[name] = factory


def registered_environments() -> list[str]:
    return sorted(_REGISTRY)


class Environments:
    """Opens the episodes of a run's prompts: `open(sample, n) -> (prompt ids, n environments)`."""

    def __init__(self, task: Any, tokenizer: Any, verifier: Any, *, chat: bool, step_timeout_s: float,
                 tools: ToolsConfig | None = None):
        self.task, self.tokenizer, self.verifier, self.chat = task, tokenizer, verifier, chat
        self.step_timeout_s = step_timeout_s
        self.tools_cfg = tools or ToolsConfig()
        self._toolbox: Toolbox | None = None
        self._toolbox_lock = threading.Lock()  # `open` runs on every replica's thread
        unknown = sorted(set(task.environments()) - set(_REGISTRY))
        if unknown:  # fail at start-up, not at the first prompt of that source
            raise ValueError(f"environment(s) {unknown} (task.sources[i].environment, or the task's own) are not "
                             f"registered; registered: {sorted(_REGISTRY)}")

    @property
    def toolbox(self) -> Toolbox:
        """Built on first use, only for runs whose tasks use tools (its sandbox pool starts on the first call)."""
        with self._toolbox_lock:
            if self._toolbox is None:
                self._toolbox = Toolbox(self.tools_cfg, self.tokenizer, self.chat)
            return self._toolbox

    def close(self) -> None:
        if self._toolbox is not None:
            self._toolbox.close()

    def stop_sequences(self) -> list[tuple[int, ...]]:
        """The stop sequences of every environment the task may use (each factory's `stop`: texts, encoded with
        the run's tokenizer, or token ids): the engine's decode program compiles them in and ends any row's turn on
        one, so they are the union over the run."""
        seqs = set()
        for name in sorted(self.task.environments()):
            factory = _REGISTRY.get(name)
            tools = getattr(factory, "needs_toolbox", False)
            stops = self.toolbox.format.stop if tools else getattr(factory, "stop", ())
            for q in stops:
                ids = self.tokenizer.encode(q) if isinstance(q, str) else [int(t) for t in q]
                if ids:
                    seqs.add(tuple(ids))
        return sorted(seqs)

    def open(self, sample: Any, n: int) -> tuple[list[int], list[Any]]:
        name = self.task.environment_for(sample)
        if name not in _REGISTRY:
            raise ValueError(f"task sample {sample.id} names environment {name!r}; registered: {sorted(_REGISTRY)}")
        factory = _REGISTRY[name]
        if getattr(factory, "needs_toolbox", False):  # the prompt offers the tools: rendered once per group
            extra = {"toolbox": self.toolbox}
            ids = self.toolbox.prompt_ids(sample.prompt)
        else:
            extra, ids = {}, self.tokenizer.encode_prompt(sample.prompt, chat=self.chat)
        envs = [factory(ids, sample, self.verifier, self.step_timeout_s, self.tokenizer, **extra) for _ in range(n)]
        opened = [env.reset() for env in envs]
        if any(list(o) != list(opened[0]) for o in opened[1:]):
            raise ValueError(f"the environments of {sample.id} open differently; a group's samples must share "
                             "their prompt")
        return list(opened[0]), envs
