"""`environment: agent`: a source whose episodes are played by the user's agent function (`agent.fn`), which calls
the policy through each inference host's OpenAI-compatible endpoint (`asyncrl/endpoint/`).

The samples are another environment's task, named in the source's options (the agent plays them instead of that
environment's episodes; its verifier grades an answer the agent returns as text):

    task:
      sources:
        - environment: agent
          options: {task: my_pkg.env:ENVIRONMENT}   # or a built-in name: digits, lookup, ...; its options beside
    agent:
      fn: my_pkg.agent:run
"""

from __future__ import annotations

import dataclasses

from asyncrl.envs.spec import EnvironmentSpec
from asyncrl.tasks.base import Task
from asyncrl.tasks.config import TaskConfig, TaskSourceConfig
from asyncrl.validate import ConfigError


def make_task(source: TaskSourceConfig, task_config: TaskConfig, where: str) -> Task:
    from asyncrl.envs.registry import resolve  # the registry names this module: imported when called, no cycle

    options = dict(source.options)
    inner = options.pop("task", None)
    if not isinstance(inner, str) or not inner or inner == "agent":
        raise ConfigError(f"{where}.options.task={inner!r} is invalid: an agent source names the environment whose "
                          "task makes its samples (a built-in name or 'package.module:ATTRIBUTE'), not 'agent'")
    spec = resolve(inner, f"{where}.options.task")
    return spec.task(dataclasses.replace(source, environment=inner, options=options), task_config, where)


ENVIRONMENT = EnvironmentSpec(task=make_task)
"""Its episodes are not opened here: the inference worker hands its prompts to the agent runner."""
