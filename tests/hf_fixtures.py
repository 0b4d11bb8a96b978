"""Tiny random Hugging Face models (PyTorch reference) written to disk for parity tests."""

from __future__ import annotations

import os

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

KINDS = ("qwen3_tied", "qwen3_untied", "llama31")


def make_hf_model(kind: str, seed: int = 0, vocab: int = 160):
    torch.manual_seed(seed)
    if kind.startswith("qwen3"):
        cfg = Qwen3Config(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24,  # head_dim independent of hidden/heads, as in Qwen3
            tie_word_embeddings=(kind == "qwen3_tied"), max_position_embeddings=512, rope_theta=1000000.0,
            eos_token_id=1, bos_token_id=None, pad_token_id=0,
        )
        model = Qwen3ForCausalLM(cfg)
    elif kind == "llama31":
        cfg = LlamaConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, rope_theta=500000.0, tie_word_embeddings=False,
            # max_position_embeddings smaller than the rope-scaling original: the published 3.1 has it larger.
            max_position_embeddings=256,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 1024},
            eos_token_id=1, bos_token_id=None, pad_token_id=0,
        )
        model = LlamaForCausalLM(cfg)
    else:
        raise ValueError(kind)
    # Random init has tiny norms/weights; widen them so logits differ meaningfully between positions.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.08)
    return model.eval()


def save_hf_model(kind: str, folder: str, seed: int = 0):
    model = make_hf_model(kind, seed)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    return model


def hf_logits(model, tokens: np.ndarray, lens: np.ndarray) -> np.ndarray:
    mask = (np.arange(tokens.shape[1])[None, :] < lens[:, None]).astype(np.int64)
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.float().numpy()


def ragged_batch(vocab: int, lens, width: int | None = None, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens, np.int32)
    width = width or int(lens.max())
    toks = rng.integers(2, vocab, size=(len(lens), width)).astype(np.int32)
    toks[np.arange(width)[None, :] >= lens[:, None]] = 0
    return toks, lens
