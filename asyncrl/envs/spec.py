"""What an environment is, in one place: the task that makes its samples and grades answers, and how an episode of
one sample is played. A config names one by import path (`task.sources[i].environment: my_pkg.envs:ENVIRONMENT`);
the built-in ones are found the same way (`registry.py`).

    ENVIRONMENT = EnvironmentSpec(task=make_task)                    # single turn: the answer graded by Task.score
    ENVIRONMENT = EnvironmentSpec(task=make_task, episode=MyEpisode)  # multi-turn: MyEpisode steps each turn

The episode protocol (`reset() -> prompt ids`, `step(turn) -> StepResult`) is `asyncrl/rollout.py`'s `Environment`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.tasks.base import Task
from asyncrl.tasks.config import TaskConfig, TaskSourceConfig
from asyncrl.validate import ConfigError

TaskFactory = Callable[[TaskSourceConfig, TaskConfig, str], Task]
"""(this source's config, the whole task section, the source's dotted key for error messages) -> Task."""
EpisodeFactory = Callable[..., Any]
"""(prompt ids, sample, verifier, step timeout in s, tokenizer) -> an episode (`reset`, `step`)."""

_TASK_ARGS = ("source", "task_config", "where")
_EPISODE_ARGS = ("prompt_ids", "sample", "verifier", "timeout_s", "tokenizer")


@dataclass(frozen=True)
class EnvironmentSpec:
    """One environment: its task data and grading (`task`) and its episodes (`episode`), together."""

    task: TaskFactory
    """Builds the source's `Task` from its config entry: samples (`Task.samples`) and, for single-turn play, the
    grade of an answer (`Task.score`, run in the verifier's worker processes)."""
    episode: EpisodeFactory | None = None
    """None: a single turn, its answer graded by `Task.score` (such a source may set `tools: true`). Otherwise
    called once per sample of a group, as `episode(prompt_ids, sample, verifier, timeout_s, tokenizer)`."""
    stop: Sequence[str | Sequence[int]] = ()
    """Texts (encoded with the run's tokenizer) or token ids that end a model turn of this environment's episodes:
    compiled into the decode program."""

    def check(self, key: str) -> None:
        """Raise a ConfigError naming `key` unless `task` and `episode` take the arguments they are called with."""
        _check_callable(key, "task", self.task, _TASK_ARGS)
        if self.episode is not None:
            _check_callable(key, "episode", self.episode, _EPISODE_ARGS)
        for s in self.stop:
            if not (isinstance(s, str) or (isinstance(s, Sequence) and all(isinstance(t, int) for t in s))):
                raise ConfigError(f"{key}: EnvironmentSpec.stop holds {s!r}: each stop must be a text or token ids")


def _check_callable(key: str, field: str, fn: Any, args: tuple[str, ...]) -> None:
    if not callable(fn):
        raise ConfigError(f"{key}: EnvironmentSpec.{field}={fn!r} is not callable")
    try:
        inspect.signature(fn).bind(*args)
    except TypeError as e:
        raise ConfigError(f"{key}: EnvironmentSpec.{field}={getattr(fn, '__qualname__', fn)!r} cannot be called "
                          f"as {field}({', '.join(args)}): {e}") from None
    except ValueError:  # a builtin without a signature: it is called as it is, and fails then if it must
        pass
