"""Decoder architecture config: one dataclass covers Llama 3/3.1, Qwen3 and Qwen3-MoE.

The families differ only in a handful of switches (q/k RMSNorm, tied embeddings, rope scaling, mixture-of-experts
MLPs), so one decoder implementation with this config is enough; see `transformer.py` and `moe.py`.
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
    "Qwen3MoeForCausalLM": "qwen3_moe",
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
    """'llama', 'qwen3' or 'qwen3_moe'. Qwen3 adds RMSNorm on q and k per head; Qwen3-MoE also routes its MLPs."""
    vocab_size: int = 512
    """Number of token embeddings (rows of the embedding table)."""
    hidden_size: int = 64
    """Residual stream width D."""
    intermediate_size: int = 192
    """SwiGLU hidden width F (of the dense MLP layers, in a mixture-of-experts model)."""
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
    num_experts: int = 0
    """Experts E per mixture-of-experts layer (HF `num_experts`); 0 for a dense model, > 0 for qwen3_moe."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k), 1 <= k <= num_experts."""
    moe_intermediate_size: int = 0
    """SwiGLU hidden width I of each expert."""
    norm_topk_prob: bool = False
    """Renormalise the k chosen routing probabilities to sum to 1 (HF `norm_topk_prob`; Qwen3-30B-A3B: true)."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layer indices whose MLP is dense (width intermediate_size) rather than a mixture of experts."""
    decoder_sparse_step: int = 1
    """Layer i routes its MLP iff (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers (HF rule)."""

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
        if self.family != "qwen3_moe":
            if self.num_experts:
                raise ModelConfigError(f"model.num_experts={self.num_experts} needs model.family='qwen3_moe' "
                                       f"(got {self.family!r})")
            return
        moe_checks = {
            "num_experts": self.num_experts > 0,
            "num_experts_per_tok": 0 < self.num_experts_per_tok <= self.num_experts,
            "moe_intermediate_size": self.moe_intermediate_size > 0,
            "decoder_sparse_step": self.decoder_sparse_step > 0,
            "mlp_only_layers": all(0 <= i < self.num_layers for i in self.mlp_only_layers),
        }
        for key, ok in moe_checks.items():
            if not ok:
                raise ModelConfigError(
                    f"model.{key}={getattr(self, key)!r} is invalid for qwen3_moe (num_experts > 0, "
                    "1 <= num_experts_per_tok <= num_experts, moe_intermediate_size > 0, decoder_sparse_step > 0, "
                    f"mlp_only_layers in [0, num_layers={self.num_layers}))"
                )
        if not self.sparse_layers:
            raise ModelConfigError(f"model: qwen3_moe with mlp_only_layers={self.mlp_only_layers!r} and "
                                   f"decoder_sparse_step={self.decoder_sparse_step} has no mixture-of-experts layer")

    @property
    def qk_norm(self) -> bool:
        return self.family in ("qwen3", "qwen3_moe")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """Indices of the mixture-of-experts layers, in order (HF's `Qwen3MoeDecoderLayer` rule); () if dense."""
        if not self.is_moe:
            return ()
        return tuple(i for i in range(self.num_layers)
                     if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Indices of the layers with a dense MLP, in order: every layer of a dense model."""
        sparse = set(self.sparse_layers)
        return tuple(i for i in range(self.num_layers) if i not in sparse)

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
        per_layer = d * (h + 2 * k) * dh + h * dh * d + 2 * d + (2 * dh if self.qk_norm else 0)
        mlps = len(self.dense_layers) * 3 * d * f + len(self.sparse_layers) * self.num_experts * (
            3 * d * self.moe_intermediate_size + d)  # + d: each expert's router row
        head = 0 if self.tie_word_embeddings else d * v
        return v * d + self.num_layers * per_layer + mlps + d + head

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """Bytes of KV cache one token occupies across all layers (the blog's K)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_value

    # ---- HF config.json <-> ModelConfig -------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ModelConfigError(f"{source}: key 'architectures' is missing; "
                                   f"expected one of {sorted(SUPPORTED_ARCHITECTURES)}")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"{source}: architectures={archs!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ModelConfigError(f"{source}: attention_bias/mlp_bias=true is not supported by this decoder")
        if cfg.get("use_sliding_window"):
            raise ModelConfigError(f"{source}: use_sliding_window=true is not supported by this decoder")

        def need(key: str) -> Any:
            if key not in cfg:
                raise ModelConfigError(f"{source}: required key {key!r} is missing")
            return cfg[key]

        # Rope lives at top level in the hub's published files and under `rope_parameters` in what
        # transformers 5 writes; accept both.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (
            rope_params if rope_params.get("rope_type") not in (None, "default") else None)
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
        moe: dict[str, Any] = {}
        if family == "qwen3_moe":
            # The hub's files say `num_experts`; what transformers 5 writes says `num_local_experts`.
            experts = cfg.get("num_experts", cfg.get("num_local_experts"))
            if experts is None:
                raise ModelConfigError(f"{source}: required key 'num_experts' is missing")
            moe = dict(num_experts=int(experts), num_experts_per_tok=int(need("num_experts_per_tok")),
                       moe_intermediate_size=int(need("moe_intermediate_size")),
                       norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                       mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
                       decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)))
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
            **moe,
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
        if self.is_moe:
            out |= {"num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                    "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                    "mlp_only_layers": list(self.mlp_only_layers), "decoder_sparse_step": self.decoder_sparse_step,
                    "use_sliding_window": False}
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
    # A mixture of experts as small as "tiny": 4 experts, top-2, layer 0 dense (Qwen3-MoE's mlp_only_layers).
    "tiny_moe": ModelConfig(
        family="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=192, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=512, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        norm_topk_prob=True, mlp_only_layers=(0,),
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
    # Qwen3-30B-A3B: 48 layers, all MoE (mlp_only_layers [], decoder_sparse_step 1), 128 experts, top-8.
    "qwen3-30b-a3b": ModelConfig(
        family="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=40960, bos_token_id=151643, eos_token_ids=(151645,), num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
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
