"""The endpoint on a run's inference host: the server over one of the host's replicas, and the agents that play
`environment: agent` groups against it.

No second decode loop: the worker's replica loop drives the served engine as before, and takes the endpoint's
requests beside its own prompts (`EngineLoop.take`), handing every finished group to `EngineLoop.finish` first. A
group of an agent source runs on a bounded pool (`agent.workers` agents at once, so at most that many sessions), and
its folded `Rollout` goes to `on_group`, the worker's shipping lane, as any other group's."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from asyncrl.endpoint.agents import AgentRunner
from asyncrl.endpoint.chat import ChatFormat
from asyncrl.endpoint.config import AgentConfig, EndpointConfig
from asyncrl.endpoint.loop import EngineLoop
from asyncrl.endpoint.server import EndpointServer
from asyncrl.inference.engine import Engine
from asyncrl.rollout import Prompt, Rollout

log = logging.getLogger(__name__)


class HostAgents:
    """`submit(prompt)` plays the prompt's group with the agent function; `on_group(rollout)` gets it, `on_error(e)`
    a failure of the runner itself (an agent's own failure ends only its episode)."""

    def __init__(self, engine: Engine, endpoint: EndpointConfig, agent: AgentConfig, group_size: int,
                 on_group: Callable[[Rollout], None], on_error: Callable[[BaseException], None],
                 grade: Callable[[str, Any], float] | None = None, tool_format: str = "auto"):
        # Driven by the worker's replica loop, not started.
        self.loop = EngineLoop(engine, endpoint.max_queued, endpoint.max_sessions)
        self.server = EndpointServer(endpoint, self.loop, ChatFormat(engine.tokenizer, tool_format))
        self.runner = AgentRunner(self.server, agent, grade=grade)
        # A group waits on its n agents: as many groups at once as keep `agent.workers` agents busy.
        self.groups = ThreadPoolExecutor(max(1, agent.workers // group_size), thread_name_prefix="agent-group")
        self.on_group, self.on_error = on_group, on_error

    def start(self) -> str:
        url = self.server.start()
        log.info("%s serves the OpenAI endpoint at %s", self.loop.engine.name, url)
        return url

    def submit(self, prompt: Prompt) -> None:
        self.groups.submit(self.runner.run_group, prompt).add_done_callback(self._done)

    def _done(self, fut: Future) -> None:
        if fut.cancelled():
            return
        try:
            self.on_group(fut.result())
        except BaseException as e:  # noqa: BLE001 - the worker stops with it, never a silent loss
            self.on_error(e)

    def close(self) -> None:
        self.groups.shutdown(wait=False, cancel_futures=True)
        self.runner.close()
        self.server.stop()
