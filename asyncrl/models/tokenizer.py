"""Tokenizer wrapper over `transformers.AutoTokenizer` from a local folder, plus power-of-two prompt buckets."""

from __future__ import annotations

import os
import string
from collections.abc import Sequence

import numpy as np

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAR_SPECIALS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def bucket_length(n: int, min_bucket: int = 16, max_len: int | None = None) -> int:
    """Next power of two >= max(n, min_bucket), capped at max_len: at most log2(max_len) distinct shapes."""
    b = max(int(min_bucket), 1)
    while b < n:
        b *= 2
    return min(b, max_len) if max_len is not None else b


class Tokenizer:
    """What the engine and tasks need from a tokenizer: ids of EOS / pad / end-of-think, chat, bucketing."""

    def __init__(self, hf, end_of_think: str = "</think>"):
        self.hf = hf
        vocab = hf.get_vocab()
        self.eos_id: int = hf.eos_token_id if hf.eos_token_id is not None else vocab.get("<|endoftext|>", 0)
        self.pad_id: int = hf.pad_token_id if hf.pad_token_id is not None else self.eos_id
        self.bos_id: int | None = hf.bos_token_id
        # Qwen3 and our char tokenizer have a single `</think>` token; Llama has none.
        self.end_of_think_id: int | None = vocab.get(end_of_think)
        self.vocab_size = len(hf)

    @classmethod
    def from_folder(cls, path: str, **kw) -> Tokenizer:
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: tokenizer folder does not exist")
        return cls(AutoTokenizer.from_pretrained(path, **kw))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode_prompt(self, prompt: str | list[dict], chat: bool = False) -> list[int]:
        """Chat messages (or text with chat=True) go through the chat template with a generation prompt."""
        if isinstance(prompt, list) or chat:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.encode(text)
        ids = self.encode(prompt)
        return ([self.bos_id] if self.bos_id is not None and getattr(self.hf, "add_bos_token", False) else []) + ids

    def pad_batch(self, prompts: Sequence[Sequence[int]], min_bucket: int = 16, max_len: int | None = None,
                  rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Right-pad token lists into [rows, bucket] int32 and lengths [rows] (missing rows have length 0)."""
        longest = max((len(p) for p in prompts), default=1)
        if max_len is not None and longest > max_len:
            raise ValueError(f"prompt of {longest} tokens exceeds the limit of {max_len}")
        width = bucket_length(longest, min_bucket, max_len)
        rows = rows or len(prompts)
        out = np.full((rows, width), self.pad_id, np.int32)
        lens = np.zeros((rows,), np.int32)
        for i, p in enumerate(prompts):
            out[i, : len(p)] = p
            lens[i] = len(p)
        return out, lens


def build_char_tokenizer(folder: str, alphabet: str = string.printable[:95] + "\n") -> str:
    """Write a character-level HF tokenizer (for the tiny model) to `folder`; returns the folder.

    Real component, not a mock: it is a `tokenizers` BPE with single-character vocab and no merges, saved as a
    PreTrainedTokenizerFast with a chat template, and loaded back through AutoTokenizer like any other."""
    from tokenizers import Tokenizer as RawTokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return folder
    vocab = {tok: i for i, tok in enumerate(CHAR_SPECIALS)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens(CHAR_SPECIALS)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|endoftext|>", pad_token="<|pad|>", chat_template=CHAT_TEMPLATE,
    )
    os.makedirs(folder, exist_ok=True)
    tmp = folder.rstrip("/") + f".tmp{os.getpid()}"
    hf.save_pretrained(tmp)
    for f in os.listdir(tmp):
        os.replace(os.path.join(tmp, f), os.path.join(folder, f))
    os.rmdir(tmp)
    return folder
