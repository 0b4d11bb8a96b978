"""The weights' layout a CPU replica decodes with (`Engine._prepare`, `AbstractPrograms.abstract_params`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from asyncrl.models import dense


@jax.jit
def cpu_decode_layout(params: Any) -> Any:
    """Half-precision leaves as f32, the stacked layers split per layer, the matrices output-major
    (`Engine._prepare`, `abstract_params`). One jitted function at module level, so each weight sync reuses its
    compiled program (a fresh jit per call would recompile on every sync: a compile per step on every replica)."""
    return dense.cpu_decode_layout(jax.tree.map(
        lambda x: x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x, params))
