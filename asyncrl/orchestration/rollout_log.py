"""`logging.rollouts_every_n_steps`: the trained groups of a step, and the groups dropped while collecting it, as
JSON lines. Each trainer host writes its own share to its own file (rollouts.jsonl, rollouts.rank1.jsonl, ...), so
nothing is gathered over the network for logging. A step's records go out in one write (`jsonl.append`), and the
driver cuts the files back to the checkpoint a resumed attempt starts from (`truncate`)."""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from asyncrl.orchestration import jsonl
from asyncrl.rollout import Completion, Rollout


def rollouts_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "rollouts.jsonl" if rank == 0 else f"rollouts.rank{rank}.jsonl")


def drop_record(step: int, rollout: Rollout, reason: str) -> dict[str, Any]:
    """One dropped group ("lag" or "zero_variance"), as logged, with the replica that generated it."""
    return {"step": step, "pid": os.getpid(), "dropped": reason, "position": rollout.prompt.position,
            "id": rollout.prompt.id, "oldest_version": rollout.oldest_version, "worker": rollout.worker}


def truncate(run_dir: str, step: int) -> None:
    """Keep the records of steps <= `step` in every rank's file (a resumed attempt redoes the steps after it)."""
    for path in glob.glob(os.path.join(run_dir, "rollouts*.jsonl")):
        jsonl.truncate(path, lambda r: r.get("step", 0) <= step)


def log_rollouts(path: str, step: int, version: int, rollouts: Sequence[Rollout], drops: Sequence[dict],
                 tokens: bool = False) -> None:
    """`tokens` (`logging.rollout_tokens`): each record also holds its prompt's ids and each completion's
    per-token arrays (`token_record`), enough to recompute from this file alone what the trainer scored."""
    jsonl.append(path, [*drops, *(_record(step, version, r, tokens) for r in rollouts)])


def token_record(c: Completion) -> dict[str, list]:
    """A completion's per-token arrays, index for index: the ids (model turns and observations), the sampler's
    logprobs (0 where forced), forced (the engine or the environment wrote it; 1/0), observation (the
    environment's; 1/0), the weight version in force at each, and the model turn each belongs to."""
    n = len(c.tokens)
    zeros = [0] * n
    return {"ids": np.asarray(c.tokens).tolist(), "logprobs": np.asarray(c.logprobs, np.float32).tolist(),
            "forced": np.asarray(c.forced, np.int8).tolist(),
            "observation": zeros if c.observation is None else np.asarray(c.observation, np.int8).tolist(),
            "versions": np.asarray(c.versions).tolist(), "turns": zeros if c.turns is None else
            np.asarray(c.turns).tolist()}


def _record(step: int, version: int, r: Rollout, tokens: bool = False) -> dict[str, Any]:
    return {"step": step, "trainer_version": version, "pid": os.getpid(), "id": r.prompt.id,
            "position": r.prompt.position, "worker": r.worker, "prompt_tokens": int(len(r.prompt_tokens)),
            "completions": [{
                "text": c.text, "reward": c.reward, "reason": c.reason, "finish": c.finish_reason,
                "n_tokens": int(len(c.tokens)), "prompt_version": c.prompt_version,
                # Multi-turn episodes: every model turn's text, the observation tokens between them, why it ended.
                **({"turns": c.turn_texts, "observation_tokens": c.observation_tokens, "end": c.end_reason}
                   if c.n_turns > 1 or c.end_reason != "done" else {}),
                **({"env_info": c.env_info} if c.env_info else {}),  # e.g. each turn's tool calls and results
                # [[first token index, version], ...]: one entry per run of equal versions
                "versions": [[0, c.start_version], *map(list, c.version_boundaries)] if len(c.tokens) else [],
                **({"tokens": token_record(c)} if tokens else {}),
            } for c in r.completions],
            **({"prompt_ids": np.asarray(r.prompt_tokens).tolist()} if tokens else {})}
