"""Environments by import path: what `task.sources[i].environment` names, and the run's task built from them.

A source names its environment as `package.module:ATTRIBUTE`, an `EnvironmentSpec`, imported in every process that
needs it (the driver first, to fail before any host starts; then every host actor, which gets the user's package
through Ray's runtime_env: `orchestration/plugins.py`). The built-in environments are named the same way: their
short names below are only spellings of their import paths, resolved by the same code as a user's.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass

from asyncrl.envs.spec import EnvironmentSpec
from asyncrl.tasks.base import Sample, Task
from asyncrl.tasks.config import TaskConfig
from asyncrl.tasks.mixture import MixtureTask
from asyncrl.validate import ConfigError

BUILTIN = {
    "digits": "asyncrl.envs.digits:ENVIRONMENT",
    "reasoning_gym": "asyncrl.envs.reasoning_gym:ENVIRONMENT",
    "math_file": "asyncrl.envs.math_file:ENVIRONMENT",
    "lookup": "asyncrl.envs.lookup:ENVIRONMENT",
    "textarena": "asyncrl.envs.textarena:ENVIRONMENT",
    "agent": "asyncrl.envs.agent:ENVIRONMENT",  # played by the user's agent function through the endpoint
}


def import_path(name: str) -> str:
    """The import path a source's `environment` value stands for."""
    return BUILTIN.get(name, name)


def resolve(name: str, key: str) -> EnvironmentSpec:
    """Import the environment `name` (a built-in name or `module:attribute`) and check it; every failure is a
    ConfigError that starts with `key` (the config field that named it)."""
    path = import_path(name)
    module, sep, attr = path.partition(":")
    bad = f"{key}={name!r} is invalid"
    if not sep or not module or not attr or not all(p.isidentifier() for p in module.split(".") + attr.split(".")):
        raise ConfigError(f"{bad}: must be a built-in environment ({', '.join(sorted(BUILTIN))}) or an import path "
                          "'package.module:ATTRIBUTE' naming an asyncrl.envs.EnvironmentSpec")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{bad}: cannot import {module!r} ({e}); is its package on PYTHONPATH?") from None
    except Exception as e:  # noqa: BLE001 - the user's module raised while importing: name the key, keep the cause
        raise ConfigError(f"{bad}: importing {module!r} raised {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{bad}: {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not isinstance(obj, EnvironmentSpec):
        kind = "a class" if isinstance(obj, type) else f"a {type(obj).__name__}"
        raise ConfigError(f"{bad}: {path} is {kind}, not an asyncrl.envs.EnvironmentSpec (e.g. "
                          "ENVIRONMENT = EnvironmentSpec(task=make_task))")
    obj.check(f"{key}={name!r}")
    return obj


@dataclass(frozen=True)
class Source:
    """One built source of the run: its task, its environment, and whether it is played with the run's tools."""

    task: Task
    spec: EnvironmentSpec
    tools: bool = False
    agent: bool = False
    """`environment: agent`: its episodes are played by the run's agent function through the endpoint."""


def build_sources(cfg: TaskConfig) -> list[Source]:
    """Every source of the task section, built: its environment imported, its task made from its options."""
    out = []
    for i, src in enumerate(cfg.sources):
        where = f"task.sources[{i}]"
        spec = resolve(src.environment, f"{where}.environment")
        if src.tools and spec.episode is not None:
            raise ConfigError(f"{where}.tools=True is invalid for environment {src.environment!r}: tools play a "
                              "single-turn environment's answer (its own episodes decide each turn)")
        task = spec.task(src, cfg, where)
        if not isinstance(task, Task):
            raise ConfigError(f"{where}.environment={src.environment!r}: its task factory returned a "
                              f"{type(task).__name__}, not an asyncrl.tasks.Task")
        out.append(Source(task, spec, bool(src.tools), import_path(src.environment) == BUILTIN["agent"]))
    seen: dict[str, int] = {}
    for i, s in enumerate(out):
        if s.task.label in seen:
            raise ConfigError(f"task.sources[{i}].options.label={s.task.label!r} is invalid: must differ from "
                              f"task.sources[{seen[s.task.label]}]'s label (set options.label)")
        seen[s.task.label] = i
    return out


def combine(sources: Sequence[Source], cfg: TaskConfig) -> Task:
    """The run's task: its one source's, or a weighted mixture of all of them."""
    if len(sources) == 1:
        return sources[0].task
    return MixtureTask([s.task for s in sources], [s.weight for s in cfg.sources])


def build_task(cfg: TaskConfig) -> Task:
    """The task a `TaskConfig` describes: its one source, or a weighted mixture of all of them."""
    return combine(build_sources(cfg), cfg)


def is_agent(source: Source) -> bool:
    """Whether the source's episodes are played by the run's agent function (`environment: agent`)."""
    return source.agent


def source_of(sources: Sequence[Source], sample: Sample) -> Source:
    """The source `sample` came from: the only one, or the one its `metadata["task"]` label names (a mixture's
    samples carry it)."""
    if len(sources) == 1:
        return sources[0]
    label = sample.metadata.get("task")
    for s in sources:
        if s.task.label == label:
            return s
    raise KeyError(f"sample {sample.id!r} has metadata task={label!r}; the sources are "
                   f"{[s.task.label for s in sources]}")
