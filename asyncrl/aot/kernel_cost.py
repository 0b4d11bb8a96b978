"""What the MXU really runs where XLA's own count is wrong: f32 dots split into bf16 passes, and JAX's Pallas
flash-attention kernels, whose declared costs are not what they execute. `hlo_cost.py` applies these rules to the
instructions it walks; each is tested against a hand count (`tests/test_aot_hlo_cost.py`)."""

from __future__ import annotations

import re

from asyncrl.models.flash import block_size


def mxu_passes(attrs: str, lhs_dtype: str, rhs_dtype: str) -> int:
    """bf16 MXU passes of one dot: an f32 dot at `Precision.HIGH` runs as 3 (bf16_3x), at `HIGHEST` as 6
    (bf16_6x); DEFAULT, and any dot of 16-bit operands, as 1."""
    prec = re.search(r"operand_precision=\{(\w+)", attrs)
    if not prec or "f32" not in (lhs_dtype, rhs_dtype):
        return 1
    return {"high": 3, "highest": 6}.get(prec.group(1).lower(), 1)


# JAX's Pallas TPU flash-attention kernels (`jax.experimental.pallas.ops.tpu.flash_attention`), by instruction name:
# the backward kernels are named with their tiles (flash_mha_bwd_dq_block_q_major_512_...), the forward after the
# function that calls it (jit_flash_attention, jvp_jit_flash_attention). The forward declares the cost of full,
# non-causal attention and the two backward kernels declare none, so their cost is counted here instead: the
# matmuls of the score blocks each kernel runs, at its tile sizes.
FLASH_KERNEL = re.compile(r"flash_mha_(fwd|bwd_dkv|bwd_dq)|flash_attention")
_FLASH_MATMULS = {"fwd": 2, "bwd_dkv": 4, "bwd_dq": 3}  # per score block: QK^T, PV | + dV, dP, dK | + dP, dQ


def causal_blocks(t: int, s: int, bq: int, bk: int) -> float:
    """Share of the [t, s] score blocks (bq x bk tiles) on or below the causal diagonal: the kernels skip the rest."""
    nq, nk = max(t // bq, 1), max(s // bk, 1)
    run = sum(min(nk, ((i + 1) * bq + bk - 1) // bk) for i in range(nq))
    return run / (nq * nk)


def flash_cost(name: str, q_dims: tuple[int, ...], k_dims: tuple[int, ...]) -> tuple[float, float, float]:
    """(matmul flops, other flops, transcendentals) of one flash kernel call named `name`, with q [B, H, T, D] and
    k [B, H, S, D] its first two operands. Every kernel recomputes the scores of the blocks it runs (2 B H T S D
    flops per full matmul, scaled to the blocks run) and exponentiates them. Causal: the name carries no flag, so
    the kernel's causal skip is assumed (asyncrl calls it causal only, `models/flash.py`)."""
    if len(q_dims) != 4 or len(k_dims) != 4:
        return 0.0, 0.0, 0.0
    kind = re.search(r"flash_mha_(fwd|bwd_dkv|bwd_dq)", name)
    B, H, T, D = q_dims
    S = k_dims[2]
    bq = re.search(r"block_q(?:_major)?_(\d+)", name)
    bk = re.search(r"block_k_major_(\d+)", name)
    tile = block_size(T) or T  # the forward's name has no tiles: models/flash.py picks them, by this rule
    scores = B * H * T * S * causal_blocks(T, S, int(bq.group(1)) if bq else tile, int(bk.group(1)) if bk else tile)
    return _FLASH_MATMULS[kind.group(1) if kind else "fwd"] * 2.0 * scores * D, 0.0, scores
