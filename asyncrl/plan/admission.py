"""The admission policy swept over lags for a finished run: what each `max_lag` buys in throughput (the pipeline
model, `sim.py`, fed with the run's costs), beside the ESS the run measured for the groups it trained at each lag
(`staleness/ess_lag{L}` in its metrics, `train/ess.py`).

The ESS a lag costs depends on the run (its learning rate, how fast the policy moves), so it is read from the run,
never modelled; lags the run never trained at show none. Adaptive admission (`async.admission: adaptive`,
`orchestration/staleness.py`) grows its reach one lag at a time while the stalest lag trained keeps its ESS at or
above `async.ess_target`: on this run's figures it would settle at the largest lag whose measured ESS, and every
smaller lag's, stays at or above the target (`adaptive_reach`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from asyncrl.plan.from_run import RunReplay, what_if
from asyncrl.plan.sim import simulate


def measured_ess_by_lag(run_dir: str) -> dict[int, tuple[float, float]]:
    """{lag: (mean ESS over the groups trained at that lag, their count)} from the run's metrics rows."""
    sums: dict[int, list[float]] = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for row in map(json.loads, filter(str.strip, f)):
            for key, value in row.items():
                if key.startswith("staleness/ess_lag"):
                    lag = int(key.removeprefix("staleness/ess_lag"))
                    n = float(row.get(f"staleness/groups_lag{lag}", 0.0))
                    acc = sums.setdefault(lag, [0.0, 0.0])
                    acc[0], acc[1] = acc[0] + value * n, acc[1] + n
    return {lag: (total / n, n) for lag, (total, n) in sorted(sums.items()) if n > 0}


def adaptive_reach(ess: dict[int, tuple[float, float]], target: float, max_lag: int) -> int | None:
    """The lag adaptive admission would settle at on these figures: the largest L <= max_lag such that every lag
    1..L was measured at an ESS >= target (lag 0 is on-policy: never held back); None when lag 1 was never measured
    (a run at max_lag 0 says nothing about staleness)."""
    if 1 not in ess:
        return None
    reach = 0
    for lag in range(1, max_lag + 1):
        if lag not in ess or ess[lag][0] < target:
            break
        reach = lag
    return reach


def sweep_admission(replay: RunReplay, run_dir: str, lags: Sequence[int]) -> list[dict[str, Any]]:
    """One row per max_lag: the model's step time and trained tokens/s at that lag, with the run's measured ESS."""
    ess = measured_ess_by_lag(run_dir)
    rows = []
    for lag in lags:
        res = simulate(replay.times, replay.lengths, what_if(replay, max_lag=lag))
        e = ess.get(lag)
        rows.append({"max_lag": lag, "step_s": res.step_s, "trained_tokens_per_s": res.trained_tokens_per_s_per_chip,
                     "lag_mean": res.lag_mean, "ess_measured": None if e is None else e[0],
                     "groups_measured": 0.0 if e is None else e[1]})
    return rows
