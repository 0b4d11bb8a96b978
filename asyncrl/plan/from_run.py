"""A finished run -> the pipeline model's inputs, and the figures the model should reproduce.

What a run logs that the model is fed with:
- `metrics.jsonl`, a row per step: the trainer's work per step (its step time less its waits for rollouts and
  syncs) against the tokens it trained, the sync's cast (`weight_sync_prepare_s`), and each inference host's pause
  for a sync (`inference/weight_sync_sync_s` less `..._park_s`, the time it took to park);
- `inference.jsonl`, every replica's cumulative counters, timestamped, every ~2 s: decode seconds, decode steps,
  row-steps (the live rows summed over steps), prefill seconds and calls. Between two reports of a replica, the
  mean decode step time at the mean occupancy is one point of the decode-step cost curve;
- `rollouts.jsonl` (`logging.rollouts_every_n_steps=1`): the completion lengths and prompt lengths of the trained
  groups, the distribution the model draws from.

What the model is checked against, over the same steps (the first `skip_steps` left out): the mean step time, the
trainer's busy share (not waiting for rollouts or syncs), the replicas' busy share (in decode or prefill calls),
the decode batch's occupancy, and the groups dropped for lag.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from asyncrl.plan.inputs import Affine, Layout, Lengths, ProgramTimes

# Cores a busy process (the trainer, a replica) asks for on a shared machine, as a share of the machine: all of it,
# the size of the thread pool XLA's CPU runtime gives each process, so two busy processes each run at half speed.
# It is the one choice with no parameter to fit, and a run alone could not fit one (its overlap hardly varies: at
# max_lag 0 the trainer's steps hardly overlap the replica's calls, at 1 and 2 nearly always). Checked on two quiet
# sets of five runs each (benchmarks/README.md, plan section): the lag what-ifs (max_lag 0, 1, 2 from each other)
# within 16% and 11% at 1.0, against 13% and 23% at 0.75 (fitted to the first set, it did not hold on the second),
# 19% and 29% at 0.6, and 31% and 42% with no contention term; on a third set (results/plan_cross_probe.json) 22% at
# 1.0 and 12% at 0.75: no share holds on every set. Averaged over the three sets, within 12% at 1.0.
PROCESS_SHARE = 1.0
IDLE_POLL_S = 0.05  # `InferenceWorker._next_requests(wait=True)`: an idle replica's blocking look at the prompts


@dataclass(frozen=True)
class Measured:
    steps: int
    step_s: float
    trainer_busy: float
    inference_busy: float
    decode_occupancy: float
    dropped_lag_per_step: float

    def row(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class RunReplay:
    times: ProgramTimes
    lengths: Lengths
    layout: Layout
    measured: Measured
    notes: list = field(default_factory=list)


def _jsonl(path: str) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


def _rows(run_dir: str) -> list[dict]:
    """The metrics rows, the last one of each step (a resumed attempt rewrites the steps after its checkpoint)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"plan --from-run: {path} is missing: is {run_dir} a run directory?")
    by_step = {int(r["step"]): r for r in _jsonl(path) if "step" in r}
    return [by_step[s] for s in sorted(by_step)]


def _median(rows: list[dict], key: str, default: float = 0.0) -> float:
    vals = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return float(np.median(vals)) if vals else default


def _decode_costs(call_rows: list[tuple[float, float, float, float]], occ_pts: list[float],
                  step_pts: list[float]) -> tuple[Affine, float]:
    """The decode program's costs: a fixed part per call and a part per step of n rows. Most calls of a replica
    that takes in rows one per call decode nothing (measured here: ~15 calls per decode step), so a per-step mean
    would charge those calls to the steps. Fitted by non-negative least squares over the report windows
    (seconds = calls x per call + steps x a + slot-steps x b); without call counts (runs before they were logged),
    the per-step means against occupancy, with no per-call part."""
    if len(call_rows) >= 4:
        from scipy.optimize import nnls

        X = np.asarray([r[:3] for r in call_rows], float)
        y = np.asarray([r[3] for r in call_rows], float)
        scale = X.max(axis=0)
        scale[scale == 0] = 1.0
        coef, _ = nnls(X / scale, y)
        per_call, a, b = coef / scale
        return Affine(float(a), float(b)), float(per_call)
    return Affine.fit(occ_pts, step_pts), 0.0


def read_run(run_dir: str, skip_steps: int = 3, process_cores: float | None = None,
             shared_cores: float | None = None) -> RunReplay:
    """The run's model inputs (solo costs on a shared machine) and measured figures. `process_cores`: the cores each
    busy process asks for on a shared machine (default `PROCESS_SHARE` of it); `shared_cores`: the machine's cores,
    instead of what `hosts.json` and this machine say (0: no contention term, the fitted costs as measured)."""
    from asyncrl.config.loader import load_run_config

    rows = _rows(run_dir)
    cfg = load_run_config(os.path.join(run_dir, "config.yaml"))
    if len(rows) <= skip_steps + 2:
        raise ValueError(f"plan --from-run: {run_dir} has {len(rows)} steps; needs more than {skip_steps + 2}")
    steady = rows[skip_steps:]
    notes: list[str] = []

    # The trainer: its work per step (what the simulator's train step stands for) against its tokens.
    def work(r: dict) -> float:
        return (r["step_time_s"] - r.get("rollout/queue_wait_s_max", 0.0)
                - r.get("weight_sync/trainer_blocked_s", 0.0))

    train = Affine.fit([r["train/tokens"] for r in steady], [max(work(r), 0.0) for r in steady])
    cast = _median(steady, "weight_sync_prepare_s")
    pause = max(_median(steady, "inference/weight_sync_sync_s") - _median(steady, "inference/weight_sync_park_s"),
                0.0)

    # The replicas: decode-step cost against occupancy, prefill per call, from the reports' deltas.
    t0, t1 = steady[0].get("time"), steady[-1].get("time")
    reports = _jsonl(os.path.join(run_dir, "inference.jsonl")) if os.path.isfile(
        os.path.join(run_dir, "inference.jsonl")) else []
    if not reports or t0 is None:
        raise ValueError(f"plan --from-run: {run_dir} has no inference.jsonl or no row times (a run from before "
                         "`launch.py plan` existed); rerun it to replay it")
    by_replica: dict[str, list[dict]] = {}
    for rep in reports:
        by_replica.setdefault(rep["host"], []).append(rep)
    occ_pts, step_pts, busy, span, slot, steps_sum, pre_s, pre_n = [], [], 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    call_rows: list[tuple[float, float, float, float]] = []  # per window: calls, steps, slot-steps, decode seconds
    rpc_s = rpc_n = host_s = calls = 0.0
    B = cfg.inference.max_decode_batch_size
    for reps in by_replica.values():
        reps = sorted(reps, key=lambda r: r["t"])
        win = [r for r in reps if t0 <= r["t"] <= t1]
        for a, b in zip(reps, reps[1:]):
            if b["decode_steps"] < a["decode_steps"]:  # a restarted attempt: its counters start again
                continue
            ds = b["decode_steps"] - a["decode_steps"]
            rpc_s += b.get("queue_rpc_s", 0.0) - a.get("queue_rpc_s", 0.0)
            rpc_n += b.get("queue_rpc_calls", 0.0) - a.get("queue_rpc_calls", 0.0)
            if "engine_s" in b:  # the engine's wall time less its device calls: host work per decode call
                device = sum(b.get(k, 0.0) - a.get(k, 0.0) for k in ("decode_time_s", "prefill_s", "extend_s"))
                host_s += max(b["engine_s"] - a["engine_s"] - device, 0.0)
                calls += b["decode_calls"] - a["decode_calls"]
            if ds > 0:
                occ_pts.append((b["slot_steps"] - a["slot_steps"]) / ds)
                step_pts.append((b["decode_time_s"] - a["decode_time_s"]) / ds)
            if "decode_calls" in a and "decode_calls" in b and b["decode_calls"] > a["decode_calls"]:
                call_rows.append((b["decode_calls"] - a["decode_calls"], ds, b["slot_steps"] - a["slot_steps"],
                                  b["decode_time_s"] - a["decode_time_s"]))
            pre_s += b["prefill_s"] - a["prefill_s"]
            pre_n += b["prefill_calls"] - a["prefill_calls"]
        if len(win) >= 2:
            a, b = win[0], win[-1]
            busy += (b["decode_time_s"] + b["prefill_s"] + b.get("extend_s", 0.0)
                     - a["decode_time_s"] - a["prefill_s"] - a.get("extend_s", 0.0))
            span += b["t"] - a["t"]
            slot += b["slot_steps"] - a["slot_steps"]
            steps_sum += b["decode_steps"] - a["decode_steps"]
    if not step_pts:
        raise ValueError(f"plan --from-run: {run_dir}/inference.jsonl has no decode steps")
    decode, call_s = _decode_costs(call_rows, occ_pts, step_pts)
    if decode.per_unit == 0.0:
        notes.append("decode-step cost: the run's occupancy hardly varied, so the cost is its mean per step, the "
                     "same at any occupancy (what-ifs that change the batch are rough)")
    prefill = Affine(pre_s / pre_n if pre_n else 0.0)

    # Lengths: the trained groups' completions, or the mean per step with no spread.
    lens, prompts = [], []
    for path in glob.glob(os.path.join(run_dir, "rollouts*.jsonl")):
        for rec in _jsonl(path):
            for c in rec.get("completions", []):
                lens.append(int(c["n_tokens"]))
            if "prompt_tokens" in rec:
                prompts.append(int(rec["prompt_tokens"]))
    if lens:
        lengths = Lengths(tuple(max(n, 1) for n in lens), int(round(np.mean(prompts))) if prompts else 16)
    else:
        notes.append("no rollouts.jsonl (logging.rollouts_every_n_steps=0): every completion is the run's mean length")
        lengths = Lengths((max(int(round(_median(steady, "rollout/completion_len_mean", 1.0))), 1),), 16)

    tw = cfg.async_.train_workers
    cores = _shared_cores(run_dir) if shared_cores is None else shared_cores
    demand = float(PROCESS_SHARE * cores if process_cores is None else process_cores)
    inf_hosts = cfg.run.hosts - tw
    replicas = max(len(by_replica), 1)
    zv = float(np.mean([r.get("rollout/filtered_zero_variance", 0.0) for r in steady])) / max(cfg.prompts_per_step, 1)
    layout = Layout(
        prompts_per_step=cfg.prompts_per_step, group_size=cfg.inference.group_size, replicas=replicas,
        decode_batch=B, max_lag=cfg.async_.max_lag, steps=len(rows), prefill_prompts=cfg.inference.max_prefill_prompts,
        decode_chunk_steps=cfg.inference.decode_chunk_steps, overlap=cfg.weightsync.overlap,
        zero_variance_share=min(zv, 0.95), filter_zero_variance=cfg.loss.filter_zero_variance,
        straggler_wait_s=cfg.async_.straggler_wait_s if tw == 1 else 0.0,
        trainer_chips=tw * cfg.run.devices_per_host, inference_chips=inf_hosts * cfg.run.devices_per_host,
        seed=cfg.run.seed, skip_steps=skip_steps, shared_cores=float(cores),
        trainer_cores=demand, replica_cores=demand)
    times = ProgramTimes(decode_step=decode, decode_call_s=call_s, prefill=prefill, train_step=train, sync_cast_s=cast,
                         sync_transfer_s=pause, queue_hop_s=rpc_s / rpc_n if rpc_n else 0.0,
                         idle_poll_s=IDLE_POLL_S, decode_call_host_s=host_s / calls if calls else 0.0)
    total = sum(r["step_time_s"] for r in steady)
    measured = Measured(
        steps=len(rows), step_s=total / len(steady),
        trainer_busy=sum(max(work(r), 0.0) for r in steady) / total,
        inference_busy=busy / span if span > 0 else float("nan"),
        decode_occupancy=slot / (steps_sum * B) if steps_sum > 0 else float("nan"),
        dropped_lag_per_step=float(np.mean([r.get("rollout/filtered_lag", 0.0) for r in steady])))
    if layout.shared_cores > 0:
        times, slow_train, slow_replica = solo_times(times, lengths, layout)
        notes.append(f"contention: the trainer and {replicas} replica(s) shared {layout.shared_cores:g} cores, each "
                     f"asking for {layout.trainer_cores:g}; replayed, its train steps took x{slow_train:.2f} their "
                     f"solo time and its replica calls x{slow_replica:.2f}: the costs fed are solo, and a what-if "
                     "is slowed by the overlap it has")
    return RunReplay(times, lengths, layout, measured, notes)


def _shared_cores(run_dir: str) -> int:
    """The cores the run's processes shared: this machine's (`os.cpu_count()` at fit time, recorded in the layout),
    when `hosts.json` puts the trainer and every inference host on one machine (a local run's simulated hosts);
    0 (a machine each, no contention) when they ran on several, or the run does not say."""
    path = os.path.join(run_dir, "hosts.json")
    try:
        with open(path) as f:
            hosts = json.load(f)
    except (OSError, json.JSONDecodeError):
        return 0
    names = {h.get("host") for h in hosts if isinstance(h, dict)}
    return (os.cpu_count() or 1) if len(hosts) > 1 and len(names) == 1 and None not in names else 0


def _scaled(t: ProgramTimes, train: float, replica: float) -> ProgramTimes:
    """`t` with the trainer's step times multiplied by `train` and the replica's compute by `replica` (its queue
    calls, and the sync, are waits on other processes: as measured)."""
    def aff(a: Affine, k: float) -> Affine:
        return Affine(a.fixed * k, a.per_unit * k)

    return replace(t, train_step=aff(t.train_step, train), decode_step=aff(t.decode_step, replica),
                   prefill=aff(t.prefill, replica), decode_call_s=t.decode_call_s * replica,
                   decode_call_host_s=t.decode_call_host_s * replica)


def solo_times(measured: ProgramTimes, lengths: Lengths, layout: Layout, rounds: int = 4
               ) -> tuple[ProgramTimes, float, float]:
    """De-contend costs fitted on a shared machine: the solo costs that, run through the model with the run's own
    layout, take as long as measured. The logs give the trainer's busy spans but the replica's work only in ~2 s
    report windows, too coarse to tell which of its calls overlapped a train step (at max_lag 0 they mostly do
    not, though both are busy in every window), so the overlap is the replay's: the model reproduces the run's
    timeline (`benchmarks/plan_validate.py`). Fixed point: solo = measured / slowdown(solo), from solo = measured;
    the slowdown hardly moves with the costs, so a few rounds settle it. Returns the solo costs and the slowdowns
    (wall / solo) of the trainer's steps and the replica's calls."""
    from asyncrl.plan.sim import Simulation

    solo, slow_t, slow_r = measured, 1.0, 1.0
    if layout.shared_cores <= 0:  # a machine per host: nothing to de-contend
        return solo, slow_t, slow_r
    for _ in range(rounds):
        sim = Simulation(solo, lengths, layout)
        sim.run()
        slow_t, slow_r = sim.cpu.train_slowdown, sim.cpu.replica_slowdown
        solo = _scaled(measured, 1.0 / slow_t, 1.0 / slow_r)
    return solo, slow_t, slow_r


# Config names a what-if may use for the layout's fields.
_CONFIG_NAMES = {"max_decode_batch_size": "decode_batch", "inference.max_decode_batch_size": "decode_batch",
                 "async.max_lag": "max_lag", "max_prefill_prompts": "prefill_prompts",
                 "inference.max_prefill_prompts": "prefill_prompts"}


def what_if(replay: RunReplay, **changes: Any) -> Layout:
    """The run's layout with some fields changed (more replicas, another max_lag, a bigger decode batch), by their
    layout names or their config names (`max_decode_batch_size` for `decode_batch`). The costs stay the run's solo
    ones: on a shared machine the what-if's own overlap slows them."""
    changes = {_CONFIG_NAMES.get(k, k): v for k, v in changes.items()}
    bad = [k for k in changes if k not in Layout.__dataclass_fields__]
    if bad:
        raise ValueError(f"plan: unknown layout field(s) {bad}; choose from {sorted(Layout.__dataclass_fields__)}")
    return Layout(**{**replay.layout.__dict__, **changes})
