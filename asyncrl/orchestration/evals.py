"""Held-out evals (trainer rank 0): launch a round of eval prompts, collect it when every group is back.

One round is in flight at a time. Eval prompts are served before train prompts by the inference hosts and sampled
at `inference.temperature`, the distribution the policy is trained to sample from, so pass@k measures that
sampler. Every collected round is kept: its metrics go to `evals.jsonl` (one line per round, whichever step
collects it) and its samples to `eval_samples.jsonl`; the step that collects it also carries its `eval/*`
metrics. The round still pending at the final step is waited for and recorded too, before the final eval.

A round is written in one batch per file (`jsonl.append`). A resumed attempt relaunches the rounds of the steps
after its checkpoint, so the driver first cuts both files back to the rounds launched up to it (`truncate`): no
round twice. (A round launched before the checkpoint and still pending at a failure is lost: its weights are.)

No Ray here: the queue operations are plain callables.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from asyncrl.orchestration import jsonl
from asyncrl.rollout import Prompt
from asyncrl.tasks import summarize_rewards

ROUNDS, SAMPLES = "evals.jsonl", "eval_samples.jsonl"


class Evals:
    def __init__(self, samples: Callable[[], Iterable[Any]], num_prompts: int, group_size: int, run_dir: str, *,
                 put: Callable[[Prompt, float], None], poll: Callable[[float], Any], qsize: Callable[[], int],
                 timeout_s: float, who: str = "trainer0"):
        self._samples, self.num_prompts, self.group_size, self.run_dir = samples, num_prompts, group_size, run_dir
        self._put, self._poll, self._qsize, self.timeout_s, self.who = put, poll, qsize, timeout_s, who
        self._eval_samples: list | None = None
        self.pending: tuple[int, int, int] | None = None  # (round, prompts, launched at step)

    def launch(self, round_: int, at_step: int) -> None:
        if self.pending is not None:
            raise RuntimeError(f"eval round {self.pending[0]} is still pending; collect it before round {round_}")
        if self._eval_samples is None:  # the same held-out prompts every round
            self._eval_samples = [s for _, s in zip(range(self.num_prompts), self._samples())]
        for i, s in enumerate(self._eval_samples):
            self._put(Prompt.for_eval(i, s, self.group_size, round_), self.timeout_s)
        self.pending = (round_, len(self._eval_samples), at_step)

    def at_step(self, step: int, total: int, every: int,
                before_launch: Callable[[], object] | None = None) -> dict[str, float]:
        """The eval metrics step `step`'s row carries: a round that came back is collected, the next is launched
        every `every` steps; at the final step the pending round is waited for and recorded, then the final eval
        runs and its metrics are returned. `before_launch` runs before a round goes out: the trainer waits there
        for the step's weight sync, so that a round at step k runs with the weights of step k."""
        if not every:
            return {}
        if step == total:
            if self.pending is not None:
                self.collect()  # recorded in evals.jsonl; the final row carries the final eval
            if before_launch is not None:
                before_launch()
            self.launch(step, step)
            return self.collect()
        out = self.collect() if self.ready() else {}
        if step % every == 0 and self.pending is None:
            if before_launch is not None:
                before_launch()
            self.launch(step, step)
        return out

    def ready(self) -> bool:
        return self.pending is not None and self._qsize() >= self.pending[1]

    def collect(self) -> dict[str, float]:
        """Wait for the pending round (at most `timeout_s` without a group arriving) and record it."""
        assert self.pending is not None, "no eval round pending"
        round_, n, at_step = self.pending
        groups, deadline = [], time.monotonic() + self.timeout_s
        while len(groups) < n:
            r = self._poll(max(0.1, min(1.0, deadline - time.monotonic())))
            if r is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.who} waited {self.timeout_s:.0f}s for eval round {round_} "
                                       f"({len(groups)}/{n} groups) on the 'eval_rollout' queue")
                continue
            deadline = time.monotonic() + self.timeout_s
            if r.prompt.eval_round == round_:  # a late group of an abandoned round is skipped
                groups.append(r)
        self.pending = None
        groups.sort(key=lambda g: g.prompt.position)  # eval-set order
        # Every eval sample, for inspection and for paired comparisons of two evals (same prompts, same order).
        jsonl.append(os.path.join(self.run_dir, SAMPLES), (
            {"round": round_, "version": g.oldest_version, "id": g.prompt.id, "answer": g.prompt.sample.answer,
             "worker": g.worker, "completions": [{"text": c.text, "reward": c.reward, "reason": c.reason}
                                                 for c in g.completions]} for g in groups))
        stats = summarize_rewards([list(g.rewards) for g in groups])
        out = {f"eval/{k}": float(v) for k, v in stats.items()}
        out["eval/reward_mean"] = float(np.mean([g.rewards.mean() for g in groups]))
        out["eval/version"] = float(min(g.oldest_version for g in groups))
        out["eval/prompts"] = float(len(groups))
        out["eval/samples"] = float(sum(len(g.completions) for g in groups))
        out["eval/at_step"] = float(at_step)
        jsonl.append(os.path.join(self.run_dir, ROUNDS), [{"round": round_, **out}])
        return out


def truncate(run_dir: str, step: int) -> None:
    """Keep the rounds launched at steps <= `step` (a round is numbered by the step that launched it)."""
    for name in (ROUNDS, SAMPLES):
        jsonl.truncate(os.path.join(run_dir, name), lambda r: r.get("round", 0) <= step)
