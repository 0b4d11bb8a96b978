"""The pipeline model at target scale: program times from `launch.py aot` (compiled for the slice, here), the
layout from the run's config, and a sweep over the trainer : inference split and max_lag.

Program times. Each is the compiled program's loop-weighted roofline time (`aot/report.py`: the larger of its
FLOPs over peak and its HBM bytes over bandwidth) divided by one stated efficiency (`Assumptions.efficiency`), the
share of the roofline the program reaches. The programs have fixed shapes, so a call costs the same whatever it
holds, as on the chip:
- decode step: the compiled [max_decode_batch_size, max_seq_len] step, whatever the number of live rows;
- prefill: the compiled [max_prefill_prompts, bucket] call for the prompt's bucket;
- train step: the compiled [train_batch_size, seq_len] step. For another trainer size it is scaled by chips: FSDP
  divides the FLOPs and HBM traffic, not the weight all-gathers, so a larger trainer than the compiled one is an
  optimistic point; and its peak memory is scaled the same way to mark splits that would not fit (an estimate:
  `launch.py aot` with that `async.train_workers` is the check);
- weight sync: the compiled cast on the trainer; the hop chain moves the inference-dtype weights one slot after
  another over one chip link per receiving chip (`ChipSpec.link_bandwidth`), pipelined in `weightsync.bucket_mb`
  buckets as `weightsync/transfer.py` does. With LoRA it moves the adapters (B alone with `freeze_a`) and each
  replica then merges them (the compiled `lora_merge`).

Rollout lengths are a log-normal with the mean and log-space spread the user states (default: half the generation
budget, the blog's lambda = 0.5, spread 0.6), clipped at the budget: the tail a step waits for. Host-side costs
(a Ray queue call, the host work around a decode call, a verifier call) are stated too; they are small against the
programs at this scale.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncrl.aot.roofline import CHIPS
from asyncrl.plan.from_run import IDLE_POLL_S
from asyncrl.plan.inputs import Affine, Layout, Lengths, ProgramTimes
from asyncrl.plan.result import Result
from asyncrl.plan.sim import simulate

if TYPE_CHECKING:  # the whole run config: the sweep reads the run's layout from every part of it
    from asyncrl.config.schema import Config


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class Assumptions:
    efficiency: float = 0.7
    """Share of its roofline time each program reaches: a stated guess (no program here has been timed on a chip;
    kernels do not run at their roofline)."""
    mean_len: float | None = None
    """Mean completion tokens; None: half the generation budget (the blog's lambda = 0.5)."""
    tail: float = 0.6
    """Log-space spread of the completion lengths (0: all equal to the mean)."""
    prompt_len: int | None = None
    """Prompt tokens; None: inference.min_prefill_bucket."""
    queue_hop_s: float = 1e-3
    """One call on a Ray queue actor (a round trip on the cluster's network)."""
    decode_call_host_s: float = 5e-4
    """Host work around each decode call (taking out finished rows, emitting groups)."""
    verifier_s: float = 0.0
    """Per sample, off the decode thread."""
    steps: int = 40
    skip_steps: int = 5

    def __post_init__(self) -> None:
        if not 0 < self.efficiency <= 1:
            raise PlanError(f"plan: efficiency={self.efficiency} must be in (0, 1]")
        if self.mean_len is not None and self.mean_len < 1:
            raise PlanError(f"plan: mean_len={self.mean_len} must be >= 1")
        if self.tail < 0:
            raise PlanError(f"plan: tail={self.tail} must be >= 0")
        if self.steps <= self.skip_steps + 1:
            raise PlanError(f"plan: steps={self.steps} must exceed skip_steps={self.skip_steps} + 1")


def _rows_by_program(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    by = {r["program"]: r for r in rows}
    missing = [p for p in ("train_step", "decode", "weight_sync_cast") if p not in by]
    if missing or not any(p.startswith("prefill[") for p in by):
        raise PlanError(f"plan: the aot rows lack {missing or ['prefill[...]']} (rerun `launch.py aot` without "
                        "--programs)")
    for name in ("decode", "weight_sync_cast", *[p for p in by if p.startswith("prefill[")]):
        if not by[name]["fits"]:
            raise PlanError(f"plan: {name} does not fit on {by[name]['topology']}: {by[name].get('error')}")
    return by


@dataclass(frozen=True)
class Target:
    """What the sweep needs from a config and its aot rows."""

    cfg: Config
    rows: dict[str, dict[str, Any]]
    assume: Assumptions

    @staticmethod
    def of(cfg: Config, rows: Sequence[dict[str, Any]], assume: Assumptions) -> Target:
        return Target(cfg, _rows_by_program(rows), assume)

    @property
    def chip(self):
        return CHIPS[self.rows["decode"]["topology"].split(":")[0]]

    @property
    def prompt_len(self) -> int:
        return self.assume.prompt_len or self.cfg.inference.min_prefill_bucket

    def lengths(self) -> Lengths:
        budget = min(self.cfg.inference.generation_budget, self.cfg.inference.max_seq_len - self.prompt_len)
        mean = self.assume.mean_len or 0.5 * budget
        return Lengths.parametric(min(mean, budget), budget, self.prompt_len, tail=self.assume.tail)

    def train_workers_options(self) -> list[int]:
        hosts, prompts = self.cfg.run.hosts, self.cfg.prompts_per_step
        return [tw for tw in range(1, hosts) if hosts % tw == 0 and prompts % tw == 0]

    def trainer_chips(self, tw: int) -> int:
        return tw * self.cfg.run.devices_per_host

    def trainer_peak_bytes(self, tw: int) -> float | None:
        """The compiled train step's peak per chip, scaled to `tw` trainer hosts; None if it was not compiled."""
        row = self.rows["train_step"]
        if not row["fits"] and not row["peak_bytes_per_chip"]:
            return None
        return row["peak_bytes_per_chip"] * row["chips"] / self.trainer_chips(tw)

    def fits(self, tw: int) -> bool:
        peak = self.trainer_peak_bytes(tw)
        return peak is not None and peak <= self.rows["train_step"]["hbm_bytes_per_chip"] and (
            self.rows["train_step"]["fits"] or tw != self.cfg.async_.train_workers)

    def sync_bytes(self) -> float:
        """Bytes one receiving chip takes in per sync after the first."""
        import jax.numpy as jnp

        from asyncrl.aot.programs import synced_values
        from asyncrl.models.sources import model_config

        item = jnp.dtype(self.cfg.inference.params_dtype).itemsize
        return synced_values(model_config(self.cfg.model), self.cfg.train.lora) * item / self.cfg.inference.tp

    def sync_transfer_s(self, tw: int) -> float:
        """The hop chain (slot i to i+1 for each of hosts / tw slots), pipelined in buckets past two slots, then
        the LoRA merge on every replica."""
        slots = self.cfg.run.hosts // tw
        whole = self.sync_bytes() / self.chip.link_bandwidth
        bucket_mb = self.cfg.weightsync.bucket_mb
        if slots >= 3 and bucket_mb > 0:
            chain = whole + (slots - 2) * min(bucket_mb * 1e6 / self.chip.link_bandwidth, whole)
        else:
            chain = (slots - 1) * whole
        merge = self.rows["lora_merge"]["roofline_s"] / self.assume.efficiency if "lora_merge" in self.rows else 0.0
        return chain + merge

    def prefill_row(self) -> dict[str, Any]:
        buckets = sorted((r["seq_len"], r) for name, r in self.rows.items() if name.startswith("prefill["))
        for size, row in buckets:
            if size >= self.prompt_len:
                return row
        raise PlanError(f"plan: prompt_len={self.prompt_len} is longer than the largest prefill bucket "
                        f"({buckets[-1][0]})")

    def times(self, tw: int) -> ProgramTimes:
        e, r = self.assume.efficiency, self.rows
        train = r["train_step"]
        if not train["roofline_s"]:
            raise PlanError(f"plan: the train step did not compile on {train['topology']} ({train.get('error')}); "
                            "no time to scale from")
        scale = train["chips"] / self.trainer_chips(tw)
        return ProgramTimes(
            decode_step=Affine(r["decode"]["roofline_s"] / e),
            prefill=Affine(self.prefill_row()["roofline_s"] / e),
            train_step=Affine(train["roofline_s"] * scale * self.train_tokens_scale / e),
            sync_cast_s=r["weight_sync_cast"]["roofline_s"] * scale / e,
            sync_transfer_s=self.sync_transfer_s(tw),
            verifier_s=self.assume.verifier_s, decode_call_host_s=self.assume.decode_call_host_s,
            idle_poll_s=IDLE_POLL_S, queue_hop_s=self.assume.queue_hop_s)

    def replicas(self, tw: int) -> int:
        """Inference replicas with `tw` trainer hosts: one per `tp` chips ('threads'), or one per host ('spmd': the
        decode batch is sharded over the host's chips, as `inference/replicas.py` builds them)."""
        inf_hosts = self.cfg.run.hosts - tw
        if self.cfg.inference.replica_mode == "spmd":
            return inf_hosts
        return inf_hosts * self.cfg.run.devices_per_host // self.cfg.inference.tp

    @property
    def train_tokens_scale(self) -> float:
        """The config's tokens per step over those the train step was compiled for: rows from another batch size
        (`--from-aot` with `train.train_batch_size=...`) are scaled by tokens (more micro-batches of one shape)."""
        c = self.cfg
        seq = -(-c.inference.max_seq_len // c.train.pad_to_multiple) * c.train.pad_to_multiple  # as aot compiles it
        return c.train.train_batch_size * seq / self.rows["train_step"]["tokens"]

    def layout(self, tw: int, max_lag: int) -> Layout:
        c, inf = self.cfg, self.cfg.inference
        dph = c.run.devices_per_host
        return Layout(
            prompts_per_step=c.prompts_per_step, group_size=inf.group_size, replicas=self.replicas(tw),
            decode_batch=inf.max_decode_batch_size, max_lag=max_lag,
            steps=self.assume.steps, prefill_prompts=inf.max_prefill_prompts,
            decode_chunk_steps=inf.decode_chunk_steps, overlap=c.weightsync.overlap,
            filter_zero_variance=c.loss.filter_zero_variance,
            straggler_wait_s=c.async_.straggler_wait_s if tw == 1 else 0.0,
            trainer_chips=self.trainer_chips(tw), inference_chips=(c.run.hosts - tw) * dph,
            seed=c.run.seed, skip_steps=self.assume.skip_steps)


@dataclass
class Point:
    train_workers: int
    max_lag: int
    trainer_chips: int
    inference_chips: int
    fits: bool
    result: Result | None
    best: bool = False

    def row(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "result"}
        if self.result is not None:
            out.update(self.result.row())
        return out


def predict(target: Target, tw: int, max_lag: int) -> Point:
    fits = target.fits(tw)
    res = simulate(target.times(tw), target.lengths(), target.layout(tw, max_lag))
    return Point(tw, max_lag, target.trainer_chips(tw), (target.cfg.run.hosts - tw) * target.cfg.run.devices_per_host,
                 fits, res)


def sweep(target: Target, lags: Iterable[int] = range(0, 5)) -> list[Point]:
    """Every valid split (train_workers dividing the hosts and the prompts) at every max_lag; the best fitting point
    (lowest step time, so most tokens per second on the slice) is marked."""
    points = [predict(target, tw, lag) for tw in target.train_workers_options() for lag in lags]
    ok = [p for p in points if p.fits]
    if ok:
        min(ok, key=lambda p: p.result.step_s).best = True
    return points


_COLS = (("train_workers", "train hosts", "d"), ("trainer_chips", "train chips", "d"),
         ("inference_chips", "inf chips", "d"), ("max_lag", "max_lag", "d"), ("step_s", "step s", ".3f"),
         ("trainer_busy", "train busy", ".2f"), ("inference_busy", "inf busy", ".2f"),
         ("decode_occupancy", "occupancy", ".2f"), ("dropped_lag", "lag drops", "d"),
         ("sync_blocked_s", "sync blocked s", ".3f"), ("generated_tokens_per_s_per_chip", "gen tok/s/chip", ".0f"))


def format_points(points: Sequence[Point]) -> str:
    head = "".join(f"{h:>15}" for _, h, _ in _COLS) + "  fits"
    lines = [head]
    for p in points:
        row = p.row()
        cells = "".join(f"{format(row[k], f):>15}" for k, _, f in _COLS)
        lines.append(cells + ("  yes" if p.fits else "  no (est.)") + ("  <- best" if p.best else ""))
    return "\n".join(lines)


def plot(points: Sequence[Point], target: Target, path: str) -> None:
    """Step time and generated tokens/s per chip against the split (at the config's max_lag) and against max_lag
    (at the config's split). Both y axes start at zero: the points are compared as ratios, and an axis fitted to
    the data drew the Qwen3-8B split's 53.4-55.3 s (3%) across the whole panel, as if it were a cliff."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = target.cfg
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = (("trainer chips", lambda p: p.max_lag == cfg.async_.max_lag, lambda p: p.trainer_chips),
              ("max_lag", lambda p: p.train_workers == cfg.async_.train_workers, lambda p: p.max_lag))
    for ax, (xlabel, keep, x_of) in zip(axes, panels):
        sel = sorted((p for p in points if keep(p)), key=x_of)
        xs = [x_of(p) for p in sel]
        ax.plot(xs, [p.result.step_s for p in sel], "o-", color="C0", label="step time (s)")
        for p in sel:
            if not p.fits:
                ax.plot(x_of(p), p.result.step_s, "x", color="red", markersize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("step time (s)", color="C0")
        ax.set_xticks(xs)
        ax.set_ylim(0, 1.08 * max([p.result.step_s for p in sel], default=0.0) or 1.0)
        ax.grid(alpha=0.3)
        ax2 = ax.twinx()
        tps = [p.result.generated_tokens_per_s_per_chip for p in sel]
        ax2.plot(xs, tps, "s--", color="C1")
        ax2.set_ylabel("generated tokens/s per chip", color="C1")
        ax2.set_ylim(0, 1.08 * max(tps, default=0.0) or 1.0)
    chips = cfg.run.hosts * cfg.run.devices_per_host
    axes[0].set_title(f"split (max_lag {cfg.async_.max_lag}; x: est. not to fit)")
    axes[1].set_title(f"max_lag ({target.trainer_chips(cfg.async_.train_workers)} of {chips} chips train)")
    fig.suptitle(f"{cfg.run.name} on {target.rows['train_step']['topology']}: launch.py plan "
                 f"(efficiency {target.assume.efficiency:g})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def describe(target: Target) -> str:
    tw = target.cfg.async_.train_workers
    t, L = target.times(tw), target.lengths()
    return (f"fed with (roofline / {target.assume.efficiency:g}): decode step {1e3 * t.decode_step.fixed:.2f} ms, "
            f"prefill[{target.prefill_row()['seq_len']}] {1e3 * t.prefill.fixed:.1f} ms/call, train step "
            f"{t.train_step.fixed:.3f} s on {target.trainer_chips(tw)} chips, sync cast {1e3 * t.sync_cast_s:.1f} ms, "
            f"chain {1e3 * t.sync_transfer_s:.1f} ms ({target.sync_bytes() / 1e9:.2f} GB per receiving chip); "
            f"completions mean {L.mean:.0f} of {max(L.completions)} tokens (spread {target.assume.tail:g}), "
            f"prompt {L.prompt}")


def slots_note(target: Target) -> str:
    opts = target.train_workers_options()
    return (f"valid splits: async.train_workers in {opts} (it must divide run.hosts={target.cfg.run.hosts} for the "
            f"hop chain's equal slots, and the {target.cfg.prompts_per_step} prompts per step)")


def closed_form_share(target: Target) -> float:
    """The blog's roofline split from the same compiled programs (`aot/split.py`), as a train share of the chips."""
    from asyncrl.aot.split import split_from_aot

    rows = list(target.rows.values())
    lam = target.lengths().mean / target.cfg.inference.max_seq_len
    s = split_from_aot(rows, lam, chips=target.cfg.run.hosts * target.cfg.run.devices_per_host,
                       chips_per_host=target.cfg.run.devices_per_host)
    return s.train_share


__all__ = ["Assumptions", "PlanError", "Point", "Target", "format_points", "plot", "predict", "sweep"]
