"""What the MXU really runs where XLA's own count is wrong: f32 dots split into bf16 passes, the convolutions TPU
lowers batched matmuls to (a window as wide as a batch dim, padded so that one tap is real), and JAX's Pallas
flash-attention kernels, whose declared costs are not what they execute. `hlo_cost.py` applies these rules to the
instructions it walks; each is tested against a hand count (`tests/test_aot_hlo_cost.py`)."""

from __future__ import annotations

import re

import numpy as np

from asyncrl.models.flash import block_size


def mxu_passes(attrs: str, lhs_dtype: str, rhs_dtype: str) -> int:
    """bf16 MXU passes of one dot: an f32 dot at `Precision.HIGH` runs as 3 (bf16_3x), at `HIGHEST` as 6
    (bf16_6x); DEFAULT, and any dot of 16-bit operands, as 1."""
    prec = re.search(r"operand_precision=\{(\w+)", attrs)
    if not prec or "f32" not in (lhs_dtype, rhs_dtype):
        return 1
    return {"high": 3, "highest": 6}.get(prec.group(1).lower(), 1)


def _window_taps(out: int, inp: int, size: int, stride: int, pad_lo: int, lhs_dil: int, rhs_dil: int) -> int:
    """Sum over output positions of the window taps that land on a real input element (not padding, not a hole
    of lhs dilation)."""
    w = np.arange(size) * rhs_dil
    total = 0
    for start in range(0, out, max(1, (1 << 22) // max(size, 1))):  # bounded temporaries for long windows
        o = np.arange(start, min(out, start + max(1, (1 << 22) // max(size, 1))))[:, None] * stride
        pos = o + w[None, :] - pad_lo
        total += int(np.count_nonzero((pos >= 0) & (pos <= (inp - 1) * lhs_dil) & (pos % lhs_dil == 0)))
    return total


def conv_macs(attrs: str, out: tuple[int, ...], lhs: tuple[int, ...], rhs: tuple[int, ...]) -> float:
    """Multiply-adds of a convolution: output batch x output features x kernel input features x, per spatial dim,
    the window taps that hit real input. TPU lowers batched matmuls to convolutions whose batch dims are spatial
    dims with a window as wide as the dim, padded so that only one tap is real: counting the whole window (or
    the padding) would over-count those by the dim's size."""
    lab = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", attrs)
    lhs_l, rhs_l, out_l = lab.group(1), lab.group(2), lab.group(3)
    macs = float(out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")])
    spatial = sorted(c for c in out_l if c.isdigit())
    win = re.search(r"window=\{([^}]*)\}", attrs)
    fields = dict(f.split("=", 1) for f in win.group(1).split()) if win else {}

    def per_dim(key: str, default: int) -> list[int]:
        return [int(x) for x in fields[key].split("x")] if key in fields else [default] * len(spatial)

    size, stride = per_dim("size", 1), per_dim("stride", 1)
    lhs_dil, rhs_dil = per_dim("lhs_dilate", 1), per_dim("rhs_dilate", 1)
    pads = [int(p.split("_")[0]) for p in fields["pad"].split("x")] if "pad" in fields else [0] * len(spatial)
    for i, d in enumerate(spatial):
        macs *= _window_taps(out[out_l.index(d)], lhs[lhs_l.index(d)], size[i], stride[i], pads[i], lhs_dil[i],
                             rhs_dil[i])
    return macs


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
