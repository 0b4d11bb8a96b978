"""Decoder architecture config: one dataclass covers Llama 3/3.1 and Qwen3.

The two families differ only in a handful of switches (q/k RMSNorm, tied embeddings, rope scaling), so one
decoder implementation with this config is enough; see `transformer.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

# HF `architectures` value -> our family name. Anything else is rejected with a clear error.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}


class ModelConfigError(ValueError):
    """A config.json (or preset) this decoder cannot represent; the message names the file and key."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency-dependent rope scaling (HF `rope_type: llama3`)."""

    factor: float = 8.0
    """How much the usable context is stretched for low frequencies."""
    low_freq_factor: float = 1.0
    """Wavelengths longer than original_max_position_embeddings / low_freq_factor are fully scaled."""
    high_freq_factor: float = 4.0
    """Wavelengths shorter than original_max_position_embeddings / high_freq_factor are left untouched."""
    original_max_position_embeddings: int = 8192
    """Context length the model was pre-trained with before scaling."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer. Field names follow the HF config.json keys where one exists."""

    family: str = "qwen3"
    """'llama' or 'qwen3'. Qwen3 adds RMSNorm on q and k per head."""
    vocab_size: int = 512
    """Number of token embeddings (rows of the embedding table)."""
    hidden_size: int = 64
    """Residual stream width D."""
    intermediate_size: int = 192
    """SwiGLU hidden width F."""
    num_layers: int = 2
    """Number of decoder blocks."""
    num_heads: int = 4
    """Query heads H."""
    num_kv_heads: int = 2
    """Key/value heads K (GQA); must divide num_heads."""
    head_dim: int = 16
    """Per-head width; independent of hidden_size / num_heads (Qwen3 uses 128 everywhere)."""
    rope_theta: float = 10000.0
    """Rotary base frequency."""
    rope_scaling: RopeScaling | None = None
    """Llama-3.1 rope scaling, or None for plain rope."""
    rms_norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm."""
    tie_word_embeddings: bool = True
    """If true the LM head reuses the embedding table and no separate lm_head weight exists."""
    max_position_embeddings: int = 4096
    """Longest position the model was configured for (informational; also written back to config.json)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id from config.json, if any."""
    eos_token_ids: tuple[int, ...] = ()
    """End-of-sequence ids from config.json (Llama-3.1 Instruct lists several)."""

    def __post_init__(self) -> None:
        checks = {
            "vocab_size": self.vocab_size > 0,
            "hidden_size": self.hidden_size > 0,
            "intermediate_size": self.intermediate_size > 0,
            "num_layers": self.num_layers > 0,
            "num_heads": self.num_heads > 0,
            "num_kv_heads": self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0,
            "head_dim": self.head_dim > 0 and self.head_dim % 2 == 0,
            "rope_theta": self.rope_theta > 0,
            "rms_norm_eps": self.rms_norm_eps > 0,
        }
        for key, ok in checks.items():
            if not ok:
                raise ModelConfigError(
                    f"model.{key}={getattr(self, key)!r} is invalid "
                    "(sizes must be positive, num_kv_heads must divide num_heads, head_dim must be even)"
                )
        if self.family not in SUPPORTED_ARCHITECTURES.values():
            raise ModelConfigError(f"model.family={self.family!r}; allowed: {sorted(SUPPORTED_ARCHITECTURES.values())}")

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    @property
    def architecture(self) -> str:
        return {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.family]

    def num_params(self) -> int:
        d, f, h, k, dh, v = (
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.vocab_size,
        )
        per_layer = d * (h + 2 * k) * dh + h * dh * d + 3 * d * f + 2 * d + (2 * dh if self.qk_norm else 0)
        head = 0 if self.tie_word_embeddings else d * v
        return v * d + self.num_layers * per_layer + d + head

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """Bytes of KV cache one token occupies across all layers (the blog's K)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_value

    # ---- HF config.json <-> ModelConfig -------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ModelConfigError(f"{source}: key 'architectures' is missing; expected one of {sorted(SUPPORTED_ARCHITECTURES)}")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"{source}: architectures={archs!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ModelConfigError(f"{source}: attention_bias/mlp_bias=true is not supported by this decoder")

        def need(key: str) -> Any:
            if key not in cfg:
                raise ModelConfigError(f"{source}: required key {key!r} is missing")
            return cfg[key]

        # Rope lives at top level in the hub's published files and under `rope_parameters` in what
        # transformers 5 writes; accept both.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope_params if rope_params.get("rope_type") not in (None, "default") else None)
        rope_scaling = None
        if scaling:
            rope_type = scaling.get("rope_type", scaling.get("type"))
            if rope_type == "llama3":
                rope_scaling = RopeScaling(
                    factor=float(scaling["factor"]),
                    low_freq_factor=float(scaling["low_freq_factor"]),
                    high_freq_factor=float(scaling["high_freq_factor"]),
                    original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                )
            elif rope_type not in (None, "default"):
                raise ModelConfigError(f"{source}: rope scaling type {rope_type!r} is not supported (only 'llama3')")

        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        family = SUPPORTED_ARCHITECTURES[arch]
        return cls(
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike) -> ModelConfig:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ModelConfigError(f"{cfg_path}: no config.json in this folder; is it a Hugging Face model folder?")
        try:
            with open(cfg_path) as f:
                cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{cfg_path}: not valid JSON ({e})") from e
        return cls.from_hf_dict(cfg, source=cfg_path)

    def to_hf_dict(self, torch_dtype: str = "float32") -> dict[str, Any]:
        """The config.json that transformers reads (hub layout: top-level rope_theta / rope_scaling)."""
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "torch_dtype": torch_dtype,
            "use_cache": True,
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            out["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return out


# ---- Presets: values from each model's published config.json ----------------------------------------------

PRESETS: dict[str, ModelConfig] = {
    # Small enough to train end to end on a 2-core laptop CPU in minutes.
    "tiny": ModelConfig(
        family="qwen3", vocab_size=128, hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=512,
    ),
    "smollm2-135m": ModelConfig(
        family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,),
    ),
    "qwen3-1.7b": ModelConfig(
        family="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
        num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=40960, bos_token_id=151643, eos_token_ids=(151645,),
    ),
    "qwen3-4b": ModelConfig(
        family="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32,
        num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=40960, bos_token_id=151643, eos_token_ids=(151645,),
    ),
    "qwen3-8b": ModelConfig(
        family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
        num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=40960, bos_token_id=151643, eos_token_ids=(151645,),
    ),
    "llama-3.1-8b": ModelConfig(
        family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), max_position_embeddings=131072, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    ),
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ModelConfigError(f"model preset {name!r} is unknown; known presets: {sorted(PRESETS)}")
    return PRESETS[name]
