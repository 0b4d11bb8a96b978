"""Decoder models (Llama 3/3.1, Qwen3) as functions over a plain param pytree, plus HF checkpoint I/O."""

from asyncrl.models.checkpoint import CheckpointError, from_pretrained, save_pretrained
from asyncrl.models.config import PRESETS, ModelConfig, ModelConfigError, RopeScaling, preset
from asyncrl.models.kvcache import KVCache
from asyncrl.models.params import LayerParams, Params
from asyncrl.models.transformer import Model

__all__ = [
    "CheckpointError", "KVCache", "LayerParams", "Model", "ModelConfig", "ModelConfigError", "PRESETS", "Params",
    "RopeScaling", "from_pretrained", "preset", "save_pretrained",
]
