"""Collecting one step's groups from the rollout queue: the blog's `get_rollouts`, with staleness kept exact
(the rule itself: `staleness.py`).

A group is dropped when it is too stale (`Staleness.drop_reason`: past max_lag, `rollout/filtered_lag`, or with
adaptive admission from a lag whose measured ESS is under the floor, `rollout/filtered_ess`) or, with
`drop_zero_variance`, when all its rewards are equal (`rollout/filtered_zero_variance`: DAPO's dynamic sampling,
such a group has zero advantage everywhere).

Oldest first. Groups finish out of order (continuous batching, several replicas). With a `pool` (groups received
but not yet trained, carried from step to step) and `urgent(version)` (positions still in flight that a later
step could not train: the prompt feeder knows them), a step waits for its urgent groups (up to
`staleness.StragglerWait` once it holds enough), trains the oldest groups it holds, and carries the rest. Without
them it takes arrivals in order, as the blog does.

`get_rollout(timeout)` is any callable that returns a Rollout, or None / raises `queue.Empty` / `TimeoutError`
when nothing came: a `queue.Queue`, a Ray queue or a test list all work.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from asyncrl.orchestration.staleness import Staleness, StragglerWait
from asyncrl.rollout import Rollout
from asyncrl.train.batch import HostMetrics

log = logging.getLogger(__name__)


# A step that drops 10 or more groups says so, at most once a minute per process: late in a DAPO run most groups
# are all-correct, and one line per 10 drops was 1,793 warning lines in a 150-step local run.
DROP_WARNING_EVERY_S = 60.0
_last_drop_warning = [float("-inf")]


class RolloutTimeout(TimeoutError):
    """The rollout queue stayed empty for longer than the collector's timeout."""


def is_zero_variance(rollout: Rollout) -> bool:
    r = rollout.rewards
    return bool(r.max() == r.min())


def episode_metrics(completions: list[Any], tools: bool = False, agents: bool = False) -> HostMetrics:
    """Per step, what the episodes looked like: model turns per episode, the share of episodes that took more than
    one, the share of completion tokens the environment appended (observations), episodes ended by each limit,
    and the seconds spent in environment steps per episode; with `tools`, the tool metrics too; with `agents`
    (agent sources), the earlier branches trained (ended 'branched', `agent.branches: keep`) and dropped."""
    tokens = sum(len(c.tokens) for c in completions)
    out = {
        "rollout/turns_mean": float(np.mean([c.n_turns for c in completions])),
        "rollout/multi_turn_share": float(np.mean([c.n_turns > 1 for c in completions])),
        "rollout/observation_share": sum(c.observation_tokens for c in completions) / max(tokens, 1),
        "rollout/env_s_mean": float(np.mean([c.env_s for c in completions])),
        # Latency per environment step (one per model turn): what a slow tool costs each turn.
        "rollout/env_step_s_mean": sum(c.env_s for c in completions) / max(sum(c.n_turns for c in completions), 1),
    }
    for reason in ("max_turns", "context", "obs_cap", "env_error"):
        out[f"rollout/ended_{reason}"] = float(sum(c.end_reason == reason for c in completions))
    if agents:
        out["rollout/branches_kept"] = float(sum(c.end_reason == "branched" for c in completions))
        out["rollout/branches_dropped"] = float(sum(i.get("dropped_branches", 0) for c in completions
                                                    for i in c.env_info))
    return {**out, **tool_metrics(completions)} if tools else out


# Every kind a tool call's error may have (`tools/calls.py`, `tools/sandbox.py`, `envs/tool_use.py`): the metrics
# have a fixed key set, because trainer hosts combine them by position (`Trainer._combine_host_metrics`).
TOOL_ERROR_KINDS = ("malformed_json", "unknown_tool", "missing_arguments", "bad_arguments", "too_many_calls",
                    "no_turn_left", "timeout", "cpu_limit", "memory", "output_limit", "exception", "forbidden",
                    "sandbox")


def tool_metrics(completions: list[Any]) -> HostMetrics:
    """Tool calls (the 'tools' environment's `info["tools"]`): calls per step and per episode, the share of
    episodes that made one, the mean call latency, and errors by kind (any other kind counts as 'other')."""
    calls = [[t for info in c.env_info for t in info.get("tools", ())] for c in completions]
    flat = [t for ep in calls for t in ep]
    out = {"tools/calls": float(len(flat)), "tools/calls_per_episode_mean": len(flat) / max(len(completions), 1),
           "tools/episode_share_mean": float(np.mean([bool(ep) for ep in calls])) if calls else 0.0,
           "tools/latency_s_mean": float(np.mean([t.get("latency_s", 0.0) for t in flat])) if flat else 0.0,
           "tools/errors": float(sum(t.get("error") is not None for t in flat))}
    for kind in (*TOOL_ERROR_KINDS, "other"):
        out[f"tools/error_{kind}"] = 0.0
    for t in flat:
        if t.get("error") is not None:
            kind = t["error"] if t["error"] in TOOL_ERROR_KINDS else "other"
            out[f"tools/error_{kind}"] += 1.0
    return out


def collect_rollouts(
    get_rollout: Callable[[float], Rollout | None],
    n_groups: int,
    version: int,
    staleness: Staleness,
    drop_zero_variance: bool = False,
    timeout_s: float = 300.0,
    who: str = "trainer",
    clock: Callable[[], float] = time.monotonic,
    on_consumed: Callable[[Rollout, str | None], None] | None = None,
    check: Callable[[], None] | None = None,
    poll_s: float = 1.0,
    pool: list[Rollout] | None = None,
    urgent: Callable[[int], set[int]] | None = None,
    zero_variance_budget: int | None = None,
    straggler: StragglerWait | float = float("inf"),
    tools: bool = False,
    agents: bool = False,
) -> tuple[list[Rollout], HostMetrics]:
    """Block until `n_groups` groups pass the filters; returns them (oldest first when pooling) and the metrics.

    `on_consumed(rollout, reason)` is told of every group as it is taken (reason None) or dropped ("lag", "ess",
    "zero_variance", "failed": no prompt ids, every episode of an agent group failed), at once: the prompt feeder
    credits a drop before this call returns, so a host short of groups gets replacements. `check()` runs between
    polls of at most `poll_s` seconds and may raise (a dead feeder thread's error then surfaces here instead of a
    generic timeout). The timeout counts from the last group received. `pool` is read and left holding the groups
    carried to the next step; `urgent(version)` returns the data positions (`rollout.prompt.position`) to wait for
    before taking newer groups, for at most `straggler` seconds (a number, or a `StragglerWait`, which is told what
    this step saw) once `n_groups` are held. After `zero_variance_budget` zero-variance drops in one call,
    zero-variance groups are kept as fillers (`rollout/zero_variance_fillers`): the loss gives them no weight when
    it filters them (`loss.filter_zero_variance`), so the step trains on the groups with variance it has instead of
    sampling without end once most prompts are solved. `tools` and `agents`: the episode metrics of tool and agent
    sources (`episode_metrics`)."""
    filtered = {"lag": 0, "ess": 0, "zero_variance": 0, "failed": 0}
    held: list[Rollout] = []

    def admit(rollout: Rollout) -> None:
        # A group with no prompt ids has nothing to train: every episode of an agent group failed before its first
        # call (agent_error / agent_timeout / agent_no_call); dropped and credited, the run goes on.
        reason = "failed" if not len(rollout.prompt_tokens) else staleness.drop_reason(version, rollout)
        if reason is None and drop_zero_variance and is_zero_variance(rollout):
            if zero_variance_budget is None or filtered["zero_variance"] < zero_variance_budget:
                reason = "zero_variance"  # else: a filler (kept; the loss weighs it 0)
        if reason is None:
            held.append(rollout)
            return
        if on_consumed is not None:
            on_consumed(rollout, reason)
        filtered[reason] += 1
        now = time.monotonic()
        if sum(filtered.values()) >= 10 and now - _last_drop_warning[0] >= DROP_WARNING_EVERY_S:
            _last_drop_warning[0] = now
            log.warning("%s dropped %d groups so far for version %d (%s); if this is frequent, raise async.max_lag "
                        "or disable zero-variance filtering (said at most every %gs)", who, sum(filtered.values()),
                        version, filtered, DROP_WARNING_EVERY_S)

    full_since: list[float] = []  # when n_groups were first held
    wait_s = straggler.current_s if isinstance(straggler, StragglerWait) else straggler
    awaited: set[int] = set()  # urgent positions missing when the step became full
    delays: list[float] = []  # how long after that each of them came
    gave_up = [False]

    def enough() -> bool:
        if len(held) < n_groups:
            return False
        if urgent is None:
            return True
        waiting = urgent(version) - {r.prompt.position for r in held}
        if not full_since:
            full_since.append(time.monotonic())
            awaited.update(waiting)
        if not waiting or sum(staleness.last_chance(version, r) for r in held) >= n_groups:
            return True
        if time.monotonic() - full_since[0] >= wait_s:
            gave_up[0] = True
            return True
        return False

    carried = list(pool or [])
    if pool is not None:
        pool.clear()
    for r in carried:  # a version later now: some may have become too stale
        admit(r)
    start = clock()  # `clock` times the wait for the metrics; the timeout runs on the real monotonic clock
    deadline = time.monotonic() + timeout_s
    while not enough():
        if check is not None:
            check()
        try:
            limit = deadline if not full_since else min(deadline, full_since[0] + wait_s)
            rollout = get_rollout(max(0.0, min(poll_s, limit - time.monotonic())))
        except (queue.Empty, TimeoutError):
            rollout = None
        if rollout is None:
            if time.monotonic() < deadline:
                continue
            waiting = sorted(urgent(version) - {r.prompt.position for r in held}) if urgent is not None else []
            raise RolloutTimeout(f"{who} waited {timeout_s:.0f}s for a rollout from the inference workers "
                                 f"(has {len(held)}/{n_groups} groups for version {version}, dropped {filtered}"
                                 + (f", waiting for data positions {waiting[:8]}" if waiting else "") + ")")
        deadline = time.monotonic() + timeout_s
        if full_since and rollout.prompt.position in awaited:
            delays.append(time.monotonic() - full_since[0])
        admit(rollout)
    waited = clock() - start
    if isinstance(straggler, StragglerWait) and full_since:
        straggler.observe(delays, gave_up[0])
    if pool is not None:  # oldest first; ties by data position, so the choice does not depend on arrival order
        held.sort(key=lambda r: (r.oldest_version, r.prompt.position))
        pool.extend(held[n_groups:])
    kept = held[:n_groups]
    if on_consumed is not None:
        for r in kept:
            on_consumed(r, None)
    lags = [staleness.lag(version, r) for r in kept]
    rewards = np.concatenate([r.rewards for r in kept])
    lengths = np.asarray([len(c.tokens) for r in kept for c in r.completions], np.float32)
    metrics = {
        "rollout/queue_wait_s_max": waited,
        "rollout/lag_min": float(min(lags)),
        "rollout/lag_max": float(max(lags)),
        "rollout/lag_mean": float(np.mean(lags)),
        "rollout/filtered_lag": float(filtered["lag"]),
        "rollout/filtered_ess": float(filtered["ess"]),
        "rollout/filtered_zero_variance": float(filtered["zero_variance"]),
        "rollout/filtered_failed": float(filtered["failed"]),
        "rollout/reward_mean": float(np.mean(rewards)),
        "rollout/completion_len_mean": float(np.mean(lengths)),
        # Completions that a weight update reached mid-generation (their tokens carry two or more versions).
        "rollout/in_flight_updated": float(sum(bool(c.version_boundaries) for r in kept for c in r.completions)),
        "rollout/carried": float(len(pool or [])),
        # The straggler wait in force this step, and whether the step gave up on an urgent group (to be dropped).
        "rollout/straggler_wait_s": float(wait_s) if wait_s != float("inf") else -1.0,
        "rollout/straggler_gave_up": float(gave_up[0]),
        "rollout/zero_variance_fillers": float(sum(drop_zero_variance and is_zero_variance(r) for r in kept)),
        **episode_metrics([c for r in kept for c in r.completions], tools, agents),
    }
    return kept, metrics
