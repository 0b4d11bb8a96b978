"""The run config: one small typed dataclass per part, composed here. Each part reads only its own section."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from asyncrl.endpoint.config import AgentConfig, EndpointConfig
from asyncrl.inference.config import InferenceConfig
from asyncrl.models.section import ModelSection
from asyncrl.orchestration.config import AsyncConfig, CheckpointConfig, EvalConfig, LoggingConfig, RunConfig
from asyncrl.orchestration.role_config import DriverConfig, HostConfig, InferenceRoleConfig, TrainerRoleConfig
from asyncrl.tasks.config import TaskConfig
from asyncrl.tools.config import ToolsConfig
from asyncrl.train.config import ShardingConfig, TrainConfig
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.registry import validate as validate_loss
from asyncrl.validate import ConfigError, check
from asyncrl.weightsync.config import WeightSyncConfig


@dataclass(frozen=True)
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    """Written `async:` in YAML and `async.x=...` on the command line (`async` is a Python keyword)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    weightsync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    """The tools of task sources played with tools (`task.sources[i].tools=true`)."""
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    """The OpenAI-compatible server each inference host runs when a source is `environment: agent`."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """The agent function that plays `environment: agent` sources (`agent.fn: my_pkg.agent:run`)."""

    def __post_init__(self) -> None:
        validate_loss(self.loss)
        if self.loss.max_tokens is None:
            # The generation budget is the inference section's; the loss (Dr.GRPO's constant normaliser, DAPO's
            # overlong buffer) reads it from its own section, filled here so that the resolved config shows it.
            object.__setattr__(self, "loss", dataclasses.replace(self.loss,
                                                                 max_tokens=self.inference.generation_budget))
        g, rows = self.inference.group_size, self.group_rows
        check("train.train_batch_size", self.train.train_batch_size, self.train.train_batch_size % rows == 0,
              f"a multiple of inference.group_size={g}" if rows == g else
              f"a multiple of inference.group_size + agent.branch_rows = {rows} (the rows of a group with "
              "agent.branches=keep)")
        tw = self.async_.train_workers
        hosts = self.run.hosts
        check("async.train_workers", tw, 0 < tw < hosts and hosts % tw == 0,
              f"in (0, run.hosts={hosts}) and divide run.hosts (the weight-sync hop chain needs equal slots)")
        prompts = self.prompts_per_step
        check("train.train_batch_size", self.train.train_batch_size, prompts % tw == 0,
              f"such that prompts per step ({prompts}) divide over async.train_workers={tw}")

        agents = self._agent_sources()
        if agents:
            check("agent.fn", self.agent.fn, bool(self.agent.fn),
                  f"an import path 'package.module:function' (task.sources[{agents[0]}] is environment: agent)")
            check("endpoint.max_sessions", self.endpoint.max_sessions,
                  self.endpoint.max_sessions >= self.agent.workers,
                  f">= agent.workers={self.agent.workers} (each running agent's session holds one)")
            # Refused until the trainer takes it: endpoint calls carry no recorded routes.
            check("train.moe.router_replay", self.train.moe.router_replay, not self.train.moe.router_replay,
                  "false with an agent source (endpoint calls do not record routes yet)")

        cp = self.sharding.mesh.cp_ulysses
        if cp > 1:
            check("train.pad_to_multiple", self.train.pad_to_multiple, self.train.pad_to_multiple % cp == 0,
                  f"a multiple of sharding.mesh.cp_ulysses={cp} (Ulysses splits every padded sequence into cp parts)")

    def _agent_sources(self) -> list[int]:
        return [i for i, s in enumerate(self.task.sources) if s.environment == "agent"]

    @property
    def keeps_branches(self) -> bool:
        """A run whose agents' branches are trained (`agent.branches: keep`): its groups vary in size."""
        return self.agent.branches == "keep" and bool(self._agent_sources())

    @property
    def group_rows(self) -> int:
        """Rows of the step's batch one group takes: its samples, plus `agent.branch_rows` when branches are kept."""
        return self.inference.group_size + (self.agent.branch_rows if self.keeps_branches else 0)

    @property
    def prompts_per_step(self) -> int:
        return self.train.train_batch_size // self.group_rows

    # ---- the config split on the way down: each role, command and program builder gets the sections it reads ----

    def trainer_role(self) -> TrainerRoleConfig:
        return TrainerRoleConfig(
            model=self.model, train=self.train, loss=self.loss, sharding=self.sharding, async_=self.async_,
            checkpoint=self.checkpoint, eval=self.eval, logging=self.logging, task=self.task, tools=self.tools,
            weightsync=self.weightsync, seed=self.run.seed, run_name=self.run.name,
            prompts_per_step=self.prompts_per_step, group_size=self.inference.group_size,
            temperature=self.inference.temperature, params_dtype=self.inference.params_dtype,
            group_rows=self.group_rows if self.keeps_branches else None)

    def inference_role(self) -> InferenceRoleConfig:
        return InferenceRoleConfig(
            model=self.model, inference=self.inference, task=self.task, tools=self.tools, async_=self.async_,
            weightsync=self.weightsync, lora=self.train.lora, seed=self.run.seed, eval_prompts=self.eval.num_prompts,
            moe=self.train.moe, endpoint=self.endpoint, agent=self.agent, train_mesh=self.sharding.mesh)

    def host_config(self) -> HostConfig:
        return HostConfig(train_workers=self.async_.train_workers, log_level=self.logging.level,
                          platform=self.run.platform, trainer=self.trainer_role(), inference=self.inference_role())

    def driver_config(self) -> DriverConfig:
        return DriverConfig(run=self.run, async_=self.async_, logging=self.logging, host=self.host_config(),
                            total_steps=self.train.total_steps, prompts_per_step=self.prompts_per_step,
                            eval_prompts=self.eval.num_prompts)


__all__ = ["Config", "ConfigError", "ModelSection"]
