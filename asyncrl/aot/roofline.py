"""How many chips (and hosts) to give the trainer versus the inference engine: the blog's roofline model.

Training is taken as compute bound (FSDP, large token batches) and decode as memory bound (prefill ignored):

    T_train     = 6 B T P / (X C)
    T_inference = lambda T (B_d T K + 2 P) / M  *  B / (B_d (A - X))

Neither side should wait on the other, so T_train = T_inference, which gives

    r   = lambda C / (6 M) * (K T / P + 2 / B_d)        (decode work / train work)
    X/A = 1 / (1 + r)

The model charges every decode step a full-length KV cache read and uses the mean rollout length, so it is a
starting point, not a measurement: the real run is stalled by the tail of the length distribution.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any


class RooflineError(ValueError):
    """An input the model cannot use; the message names the argument and the allowed range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ChipSpec:
    """Peak numbers of one accelerator chip, as the vendor publishes them."""

    flops: float
    """Dense bf16 FLOP/s (C)."""
    bandwidth: float
    """HBM bytes/s (M)."""
    hbm_bytes: float
    """HBM capacity per chip, which bounds B_d."""
    chips_per_host: int
    """Chips one host (one JAX process) drives in a single-host slice."""
    pod_chips_per_host: int | None = None
    """Chips per host once a slice spans several hosts, where that differs."""
    link_bandwidth: float = 100e9
    """Bytes/s one way over one chip-to-chip link (ICI, NVLink): what one weight-sync hop into a chip gets
    (`plan/target.py`). v5p: 4800 Gbps over 6 links; v6e: 3584 Gbps over 4; v5e: 1600 Gbps over 4."""

    def chips_per_host_for(self, chips: int) -> int:
        if chips < self.chips_per_host:  # a sub-host slice (v6e-4, 4 of 8 GPUs) is still one host
            return chips
        if self.pod_chips_per_host is not None and chips > self.chips_per_host:
            return self.pod_chips_per_host
        return self.chips_per_host


CHIPS: dict[str, ChipSpec] = {
    "v5p": ChipSpec(459e12, 2765e9, 95e9, 4, link_bandwidth=100e9),
    # v6e-8 is one VM with 8 chips, but GCP (and Ray's TPU code) lay out v6e-16 and up as 4 chips per host.
    "v6e": ChipSpec(918e12, 1640e9, 32e9, 8, pod_chips_per_host=4, link_bandwidth=112e9),
    "v5e": ChipSpec(197e12, 819e9, 16e9, 8, pod_chips_per_host=4, link_bandwidth=50e9),
    "h100": ChipSpec(989e12, 3.35e12, 80e9, 8, link_bandwidth=450e9),
    "h200": ChipSpec(989e12, 4.8e12, 141e9, 8, link_bandwidth=450e9),
}


@dataclass(frozen=True)
class Split:
    """One integer train/inference allocation and what the model predicts for it."""

    train_chips: int
    inference_chips: int
    train_hosts: int | None
    """None when the split is at chip level, or no chips_per_host was given."""
    inference_hosts: int | None
    train_seconds_per_sequence: float
    """Wall time the trainer spends per sequence (its chips working in parallel)."""
    inference_seconds_per_sequence: float
    """Wall time the inference chips spend generating one sequence, amortised over all of them."""
    sequences_per_second: float
    """Pipeline throughput: the slower side sets it."""
    efficiency: float
    """Throughput relative to the fractional optimum X = A / (1 + r); 1.0 means perfectly balanced."""
    bottleneck: str
    """'train' or 'inference': the side the other one waits on."""


@dataclass(frozen=True)
class RooflineResult:
    params: float
    kv_bytes_per_token: float
    seq_len: int
    decode_batch: int
    rollout_fraction: float
    chip_flops: float
    chip_bandwidth: float
    chips: int
    chips_per_host: int | None
    chip_hbm_bytes: float | None
    r: float
    """Total decode time over total train time, both summed over chips (beta / alpha in the blog)."""
    train_share: float
    """X / A = 1 / (1 + r)."""
    ideal_train_chips: float
    """A / (1 + r), before rounding."""
    train_chip_seconds_per_sequence: float
    """alpha per sequence: 6 T P / C."""
    inference_chip_seconds_per_sequence: float
    """beta per sequence: lambda T (B_d T K + 2 P) / (M B_d)."""
    decode_step_seconds: float
    """One decode step of a B_d batch on one chip: (B_d T K + 2 P) / M."""
    decode_arithmetic_intensity: float
    """FLOPs per HBM byte of a decode step; above C / M the memory-bound assumption fails."""
    max_decode_batch: int | None
    """Largest B_d whose bf16 weights plus full-length KV caches fit one chip's HBM; None without chip_hbm_bytes."""
    train_chips: int
    """Best integer chip split for the trainer."""
    inference_chips: int
    chip_split: Split
    hosts: int | None
    host_split: Split | None
    """Best split in whole hosts, ignoring the weight-sync constraint; None with fewer than 2 hosts."""
    train_workers: int | None
    """Recommended `async.train_workers`: the best host split whose train_workers divides the host count."""
    valid_host_split: Split | None
    warnings: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["warnings"] = list(self.warnings)
        return out


def valid_train_workers(hosts: int) -> list[int]:
    """Host counts the trainer may take: the hop-chain weight sync pairs hosts, so train_workers must divide hosts."""
    return [t for t in range(1, hosts) if hosts % t == 0]


def _check(name: str, value: float, ok: bool, allowed: str) -> None:
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        raise RooflineError(name, f"{name}={value!r} is invalid; allowed: {allowed}")


def allocate(alpha: float, beta: float, chips: int, chips_per_host: int | None
             ) -> tuple[Split, int | None, Split | None, Split | None, int | None, list[str]]:
    """The best integer splits of `chips` given the chip-seconds one sequence costs to train (alpha) and to
    generate (beta): by chip, by whole host, and by host with train_workers dividing the hosts (the hop chain).
    Returns (chip_split, hosts, host_split, valid_host_split, train_workers, warnings)."""
    share = 1 / (1 + beta / alpha)
    ideal_throughput = chips / (alpha + beta)

    def split(train_hosts: int | None, train: int, inference_hosts: int | None = None) -> Split:
        t_train, t_inf = alpha / train, beta / (chips - train)
        step = max(t_train, t_inf)
        return Split(
            train_chips=train,
            inference_chips=chips - train,
            train_hosts=train_hosts,
            inference_hosts=inference_hosts,
            train_seconds_per_sequence=t_train,
            inference_seconds_per_sequence=t_inf,
            sequences_per_second=1 / step,
            efficiency=(1 / step) / ideal_throughput,
            bottleneck="train" if t_train >= t_inf else "inference",
        )

    def best(candidates: list[Split]) -> Split:
        # The throughput optimum is always one of the two candidates bracketing the fractional optimum, but not
        # always the nearer one; ties go to the nearer.
        return max(candidates, key=lambda s: (s.sequences_per_second, -abs(s.train_chips - chips * share)))

    chip_split = best([split(None, x) for x in range(1, chips)])
    warnings: list[str] = []

    hosts = host_split = valid_split = train_workers = None
    if chips_per_host is not None:
        hosts = chips // chips_per_host
        if hosts < 2:
            warnings.append(
                f"{hosts} host: the host-level split (async.train_workers) needs at least 2 hosts; "
                "only the chip-level split applies"
            )
        else:
            by_hosts = {h: split(h, h * chips_per_host, hosts - h) for h in range(1, hosts)}
            host_split = best(list(by_hosts.values()))
            valid_split = best([by_hosts[h] for h in valid_train_workers(hosts)])
            train_workers = valid_split.train_hosts

    return chip_split, hosts, host_split, valid_split, train_workers, warnings


def roofline(
    params: float,
    kv_bytes_per_token: float,
    seq_len: int,
    decode_batch: int,
    rollout_fraction: float,
    chip_flops: float,
    chip_bandwidth: float,
    chips: int,
    chips_per_host: int | None = None,
    chip_hbm_bytes: float | None = None,
) -> RooflineResult:
    """Split `chips` between training and inference so that neither side waits (blog notation: P, K, T, B_d,
    lambda, C, M, A)."""
    _check("params", params, params > 0, "> 0")
    _check("kv_bytes_per_token", kv_bytes_per_token, kv_bytes_per_token > 0, "> 0")
    _check("seq_len", seq_len, isinstance(seq_len, numbers.Integral) and seq_len >= 1, "integer >= 1")
    _check("decode_batch", decode_batch, isinstance(decode_batch, numbers.Integral) and decode_batch >= 1,
           "integer >= 1")
    _check("rollout_fraction", rollout_fraction, 0 < rollout_fraction <= 1, "0 < rollout_fraction <= 1")
    _check("chip_flops", chip_flops, chip_flops > 0, "> 0")
    _check("chip_bandwidth", chip_bandwidth, chip_bandwidth > 0, "> 0")
    _check("chips", chips, isinstance(chips, numbers.Integral) and chips >= 2,
           "integer >= 2 (at least one train and one inference chip)")
    if chips_per_host is not None:
        _check("chips_per_host", chips_per_host,
               isinstance(chips_per_host, numbers.Integral) and chips_per_host >= 1, "integer >= 1")
        if chips % chips_per_host:
            raise RooflineError("chips",
                                f"chips={chips} is not a whole number of hosts of chips_per_host={chips_per_host}")
    if chip_hbm_bytes is not None:
        _check("chip_hbm_bytes", chip_hbm_bytes, chip_hbm_bytes > 0, "> 0")

    p, k, t, bd, lam = float(params), float(kv_bytes_per_token), seq_len, decode_batch, float(rollout_fraction)
    alpha = 6 * t * p / chip_flops
    step_bytes = bd * t * k + 2 * p
    decode_step = step_bytes / chip_bandwidth
    beta = lam * t * decode_step / bd
    r = beta / alpha
    share = 1 / (1 + r)
    chip_split, hosts, host_split, valid_split, train_workers, warnings = allocate(alpha, beta, chips, chips_per_host)

    intensity = 2 * p * bd / step_bytes
    if intensity > chip_flops / chip_bandwidth:
        warnings.append(
            f"decode at decode_batch={bd} does {intensity:.0f} FLOP/byte, above the chip's "
            f"{chip_flops / chip_bandwidth:.0f}: decode is compute bound and slower than modelled, "
            "so inference needs more chips than recommended"
        )

    max_decode_batch = None
    if chip_hbm_bytes is not None:
        # Same per-chip picture as the step time: a full bf16 weight copy plus B_d caches of length T.
        max_decode_batch = max(0, math.floor((chip_hbm_bytes - 2 * p) / (t * k)))
        if bd > max_decode_batch:
            warnings.append(
                f"decode_batch={bd} does not fit: 2P + B_d T K = {(2 * p + bd * t * k) / 1e9:.1f} GB exceeds "
                f"{chip_hbm_bytes / 1e9:.1f} GB of HBM per chip (at most B_d={max_decode_batch})"
            )

    return RooflineResult(
        params=p,
        kv_bytes_per_token=k,
        seq_len=t,
        decode_batch=bd,
        rollout_fraction=lam,
        chip_flops=float(chip_flops),
        chip_bandwidth=float(chip_bandwidth),
        chips=chips,
        chips_per_host=chips_per_host,
        chip_hbm_bytes=None if chip_hbm_bytes is None else float(chip_hbm_bytes),
        r=r,
        train_share=share,
        ideal_train_chips=chips * share,
        train_chip_seconds_per_sequence=alpha,
        inference_chip_seconds_per_sequence=beta,
        decode_step_seconds=decode_step,
        decode_arithmetic_intensity=intensity,
        max_decode_batch=max_decode_batch,
        train_chips=chip_split.train_chips,
        inference_chips=chip_split.inference_chips,
        chip_split=chip_split,
        hosts=hosts,
        host_split=host_split,
        train_workers=train_workers,
        valid_host_split=valid_split,
        warnings=tuple(warnings),
    )
