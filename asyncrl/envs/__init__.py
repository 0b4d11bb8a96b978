"""Environments: each one is its task data and its episodes together (`EnvironmentSpec`), named by import path in
`task.sources[i].environment`; the built-in ones (digits, reasoning_gym, math_file, lookup, textarena) are named the
same way (`registry.py`).

    sources = build_sources(cfg.task)              # every source's environment imported, its task built
    task = combine(sources, cfg.task)              # one source's task, or a weighted MixtureTask
    envs = Environments(sources, tokenizer, verifier, chat=..., step_timeout_s=...)
    prompt_ids, episodes = envs.open(sample, n)    # the protocol: `asyncrl/rollout.py`, `Environment`
"""

from asyncrl.envs.environments import Environments
from asyncrl.envs.registry import BUILTIN, Source, build_sources, build_task, combine, resolve, source_of
from asyncrl.envs.spec import EnvironmentSpec

__all__ = ["BUILTIN", "EnvironmentSpec", "Environments", "Source", "build_sources", "build_task", "combine",
           "resolve", "source_of"]
