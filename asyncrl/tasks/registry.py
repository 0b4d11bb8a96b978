"""Tasks by name: the table that `task.sources[i].name` selects from, and `build_task`.

The built-in tasks are plain modules that know nothing of the registry; this module imports them and lists
their factories, so imports run one way (base <- task modules <- registry) and there is no cycle.
`register_task` adds a task of one's own to the same table.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncrl.tasks.base import Task
from asyncrl.tasks.config import TaskConfig, TaskSourceConfig
from asyncrl.tasks.digits import build_digits
from asyncrl.tasks.gym import build_gym
from asyncrl.tasks.lookup import build_lookup
from asyncrl.tasks.math_files import build_math_file
from asyncrl.tasks.mixture import MixtureTask
from asyncrl.tasks.textarena import build_textarena
from asyncrl.validate import ConfigError

TaskFactory = Callable[[TaskSourceConfig, TaskConfig, str], Task]
"""(source config, whole task config, dotted key of the source for error messages) -> Task."""

_REGISTRY: dict[str, TaskFactory] = {
    "digits": build_digits,
    "reasoning_gym": build_gym,
    "math_file": build_math_file,
    "lookup": build_lookup,
    "textarena": build_textarena,
}


def register_task(name: str) -> Callable[[TaskFactory], TaskFactory]:
    """Decorator: make `factory` buildable as `task.sources[i].name=<name>`."""

    def deco(factory: TaskFactory) -> TaskFactory:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"task {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return deco


def registered_tasks() -> list[str]:
    return sorted(_REGISTRY)


def build_source(source: TaskSourceConfig, cfg: TaskConfig, where: str = "task.sources[0]") -> Task:
    """Build the task one source entry describes."""
    if source.name not in _REGISTRY:
        raise ConfigError(f"{where}.name={source.name!r} is invalid: must be one of {sorted(_REGISTRY)}")
    task = _REGISTRY[source.name](source, cfg, where)
    if source.environment is not None:  # the same questions, played in another environment (e.g. with tools)
        task.environment = source.environment
    return task


def build_task(cfg: TaskConfig) -> Task:
    """The task a `TaskConfig` describes: its one source, or a weighted mixture of all of them."""
    tasks = [build_source(s, cfg, f"task.sources[{i}]") for i, s in enumerate(cfg.sources)]
    seen: dict[str, int] = {}
    for i, t in enumerate(tasks):
        if t.label in seen:
            raise ConfigError(f"task.sources[{i}].options.label={t.label!r} is invalid: must differ from "
                              f"task.sources[{seen[t.label]}]'s label (set options.label)")
        seen[t.label] = i
    if len(tasks) == 1:
        return tasks[0]
    return MixtureTask(tasks, [s.weight for s in cfg.sources])
