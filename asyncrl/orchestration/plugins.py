"""The user's environments, on every host: imported by the driver before anything starts, shipped with the job.

Each `task.sources[i].environment` is imported here first (`asyncrl.envs.resolve`: a bad path, a missing attribute
or a wrong signature is a ConfigError naming the key, before Ray or any host starts). The package that holds it, when
it is the user's own source folder (not asyncrl's, not one installed in site-packages, which every host is expected
to have installed alike), goes to every host actor through the job's Ray runtime_env `py_modules`: Ray uploads the
folder once and puts its copy on each worker's path, on a one-machine cluster as on a real one. `launch.py submit` ships
it the same way with the job, so that the driver on the head can import it too.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

from asyncrl.endpoint.agents import resolve as resolve_agent
from asyncrl.envs.registry import import_path, resolve
from asyncrl.tasks.config import TaskConfig

# Set by Ray's job supervisor in a submitted job's driver (ray._private.runtime_env.constants): its runtime_env.
RAY_JOB_CONFIG = "RAY_JOB_CONFIG_JSON_ENV_VAR"
# Where installed packages live: those are the environment's to provide on each host, not ours to upload.
_INSTALLED = ("site-packages", "dist-packages")


def import_environments(cfg: TaskConfig, agent_fn: str = "") -> list[str]:
    """Import and check every source's environment, and the agent function (`agent.fn`) when a source is played by
    one; return the local folders (or single-file modules) of the user packages that hold them, for Ray's
    `py_modules`."""
    shipped: list[str] = []
    modules = []
    for i, src in enumerate(cfg.sources):
        resolve(src.environment, f"task.sources[{i}].environment")
        modules.append(import_path(src.environment).partition(":")[0])
        inner = src.options.get("task") if src.environment == "agent" else None
        if isinstance(inner, str) and inner:
            resolve(inner, f"task.sources[{i}].options.task")
            modules.append(import_path(inner).partition(":")[0])
    if agent_fn and any(s.environment == "agent" for s in cfg.sources):
        resolve_agent(agent_fn)  # a ConfigError naming agent.fn
        modules.append(agent_fn.partition(":")[0])
    for module in modules:
        path = package_path(module)
        if path is not None and path not in shipped:
            shipped.append(path)
    return shipped


def package_path(module: str) -> str | None:
    """The folder of `module`'s top-level package (or its file, for a top-level module) when it is user source to
    ship; None for asyncrl itself and for installed packages."""
    top = module.split(".")[0]
    if top == "asyncrl":
        return None
    spec = importlib.util.find_spec(top)
    if spec is None:
        return None
    locations: Sequence[str] = list(spec.submodule_search_locations or [])
    path = locations[0] if locations else spec.origin
    if not path or not os.path.exists(path) or any(p in _INSTALLED for p in path.split(os.sep)):
        return None
    return os.path.abspath(path)
