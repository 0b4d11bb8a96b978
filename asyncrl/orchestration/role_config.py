"""What each role of a run reads: the typed sections of the run config, split off it on the way down
(`asyncrl.config.schema.Config.driver_config()` and its siblings). A role's signature names every setting it
depends on; none of them sees the whole config.

    DriverConfig         the driver (driver.py): the run's layout, restarts, logging; hands HostConfig to each host
    HostConfig           one host actor (host.py): its role, and that role's config
    TrainerRoleConfig    a trainer host (trainer_worker.py, trainer_setup.py, checkpoint.py, export.py)
    InferenceRoleConfig  an inference host (inference_worker.py)

Ray pickles them to the host actors like any dataclass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from asyncrl.endpoint.config import AgentConfig, EndpointConfig
from asyncrl.inference.config import InferenceConfig
from asyncrl.models.section import ModelSection
from asyncrl.orchestration.config import AsyncConfig, CheckpointConfig, EvalConfig, LoggingConfig, RunConfig
from asyncrl.tasks.config import TaskConfig
from asyncrl.tools.config import ToolsConfig
from asyncrl.train.config import LoraConfig, MeshConfig, MoeConfig, ShardingConfig, TrainConfig
from asyncrl.train.loss_config import LossConfig
from asyncrl.weightsync.config import WeightSyncConfig


@dataclass(frozen=True)
class TrainerRoleConfig:
    """A trainer host: it builds the model and the trainer, feeds prompts and runs evals (rank 0), collects and
    trains, syncs weights to inference, checkpoints and exports."""

    model: ModelSection
    train: TrainConfig
    loss: LossConfig
    sharding: ShardingConfig
    async_: AsyncConfig
    checkpoint: CheckpointConfig
    eval: EvalConfig
    logging: LoggingConfig
    task: TaskConfig
    tools: ToolsConfig
    """For the format warm-start of tool tasks, in the tool episodes' own layout."""
    weightsync: WeightSyncConfig
    seed: int
    """`run.seed`: the model's init and the warm-start."""
    run_name: str
    """`run.name`: the Ray metrics' label."""
    prompts_per_step: int
    """`train.train_batch_size // inference.group_size` (// group_rows when agent branches are kept)."""
    group_size: int
    """`inference.group_size`: samples per prompt, for the feeder."""
    temperature: float
    """`inference.temperature`: the sampler's, which the loss divides the trainer's logits by."""
    params_dtype: str
    """`inference.params_dtype`: the dtype weights are cast to before they are synced."""
    group_rows: int | None = None
    """With `agent.branches: keep`, the rows each group takes in the step's batch (`inference.group_size +
    agent.branch_rows`: its kept branches, then masked filler rows); None: a group is exactly its samples."""


@dataclass(frozen=True)
class InferenceRoleConfig:
    """An inference host: replicas decoding with the synced weights, the tasks' environments and verifier, and the
    weight-sync monitor."""

    model: ModelSection
    inference: InferenceConfig
    task: TaskConfig
    tools: ToolsConfig
    async_: AsyncConfig
    weightsync: WeightSyncConfig
    lora: LoraConfig
    """`train.lora`: what a weight sync carries (the adapters after the first) and how the replicas merge it."""
    seed: int
    """`run.seed`: the replicas' sampling."""
    eval_prompts: int
    """`eval.num_prompts`: the bound of the eval shipping lane."""
    moe: MoeConfig = field(default_factory=MoeConfig)
    """`train.moe`: with router_replay, the replicas record each sampled token's experts (`Completion.routes`)."""
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    """`endpoint`: the OpenAI-compatible server a host with agent sources runs over its first replica."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """`agent`: the function that plays `environment: agent` sources."""
    train_mesh: MeshConfig = field(default_factory=MeshConfig)
    """`sharding.mesh`: the trainer mesh, whose device order the weight sync's first slot follows
    (`weightsync/transfer.py`, `first_slot`)."""


@dataclass(frozen=True)
class HostConfig:
    """One host actor: whether it trains or runs inference (`rank < train_workers` trains), and both roles' configs
    (the host picks its own)."""

    train_workers: int
    """`async.train_workers`."""
    log_level: str
    """`logging.level`."""
    platform: str
    """`run.platform`: 'cpu' turns on the CPU collectives and transfers."""
    trainer: TrainerRoleConfig
    inference: InferenceRoleConfig


@dataclass(frozen=True)
class DriverConfig:
    """The driver: where the run lives, how many hosts it places and how, its queues, restarts, console and metrics
    logging; each host actor gets `host`."""

    run: RunConfig
    async_: AsyncConfig
    logging: LoggingConfig
    host: HostConfig
    total_steps: int
    """`train.total_steps`: the progress bar's length."""
    prompts_per_step: int
    """The queues' sizes."""
    eval_prompts: int
    """`eval.num_prompts`: the eval queues' size."""

    @property
    def resume(self) -> bool:
        """`checkpoint.resume`: the trainer's setting, which the driver also reads (one value, kept in one place)."""
        return self.host.trainer.checkpoint.resume

    def with_resume(self) -> DriverConfig:
        """The config of a restart: resume from the latest checkpoint."""
        trainer = self.host.trainer
        trainer = dataclasses.replace(trainer, checkpoint=dataclasses.replace(trainer.checkpoint, resume=True))
        return dataclasses.replace(self, host=dataclasses.replace(self.host, trainer=trainer))
