"""The receiving end of a weight sync's payload: what the hop chain brings, and the params the engines get.

A full fine-tune moves the params themselves. With LoRA (`train.lora`) the trainer sends the base once, on the
attempt's first sync, and the adapters on every sync (both in inference.params_dtype; with A frozen, B alone after
the first); the receiver keeps the base (and the frozen A) and merges on receipt (W + alpha/r A B, `lora.merge`),
once per sync. The engines then decode with plain weights, so per-token versions and in-flight updates work as
without LoRA, and a decode step costs what it costs without adapters. Why merge rather than apply the adapters
unmerged in every decode step: at 8B, one merge costs about what one unmerged decode step adds to a few dozen
steps, and hundreds of steps run between syncs; the price is the kept base, a second copy of the weights
(benchmarks/README.md, "lora", has the figures of both).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from asyncrl.models import lora as lora_lib, params as params_lib
from asyncrl.models.config import ModelConfig
from asyncrl.train.config import LoraConfig


class SyncPayload:
    def __init__(self, mcfg: ModelConfig, dtype: Any, lora_cfg: LoraConfig):
        self.params_shapes = params_lib.shapes(mcfg, jnp.dtype(dtype))
        self.lora = lora_cfg if lora_cfg.enabled else None
        self.base: Any = None
        self.kept_a: Any = None  # with A frozen (train.lora.freeze_a): A from the first sync, kept with the base
        if self.lora is not None:
            self.adapter_shapes = lora_lib.shapes(mcfg, self.lora.rank, self.lora.targets, jnp.dtype(dtype))
            scale, dtype = self.lora.scale, jnp.dtype(dtype)
            self._merge = jax.jit(lambda b, a: params_lib.cast(lora_lib.merge(b, a, scale), dtype))

    def shapes(self, full: bool) -> Any:
        """The tree the sync of this kind brings (a restore target for the hop chain)."""
        if self.lora is None:
            return self.params_shapes
        if full and self.base is not None:  # a new base replaces the old: free it before it lands
            jax.tree.map(lambda x: x.delete(), (self.base, self.kept_a))
            self.base = self.kept_a = None
        adapters = lora_lib.synced(self.adapter_shapes, full, self.lora.freeze_a)
        return {"adapters": adapters, **({"base": self.params_shapes} if full else {})}

    def params(self, received: Any, version: int) -> Any:
        """The engines' params from what arrived."""
        if self.lora is None:
            return received
        adapters = received["adapters"]
        if "base" in received:
            self.base = received["base"]
            if self.lora.freeze_a:
                self.kept_a = {f: pair["a"] for f, pair in adapters.items()}
        if self.base is None:
            raise RuntimeError(f"weight sync v{version} brought LoRA adapters alone, but this host never received "
                               "the base (the trainer sends it on the first sync of each attempt)")
        if self.lora.freeze_a:
            adapters = {f: {"a": self.kept_a[f], "b": pair["b"]} for f, pair in adapters.items()}
        merged = self._merge(self.base, adapters)
        jax.tree.map(lambda x: x.delete(), [pair["b"] if self.lora.freeze_a else pair for pair in adapters.values()])
        return merged
