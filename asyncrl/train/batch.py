"""Rollouts -> one RL batch, and padding (collecting the groups from a queue, with the staleness and
zero-variance filters, is `collect.py`).

`build_batch` turns this host's groups into a host-local numpy `RLBatch`. Sequence lengths are padded up to a
multiple of `pad_to_multiple` so that the number of compiled train steps stays bounded. DAPO's overlong
shaping happens there (`train/shaping.py`): the penalty is added to `rewards` before advantages are taken, and
overlong filtering clears the loss mask of truncated completions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import numpy as np

from asyncrl.rollout import Rollout
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.shaping import shaping_for

log = logging.getLogger(__name__)

HostMetrics = dict[str, float]


@jax.tree_util.register_dataclass
@dataclass
class RLBatch:
    """One optimizer step's sequences. B = prompts x group size, T = padded length (prompt + completion).

    Index t of every [B, T] field refers to token t: `sampler_logprobs[b, t]` is the sampler's logprob of
    `tokens[b, t]` given the tokens before it. Leaves are numpy arrays on the host and jax arrays once sharded."""

    tokens: np.ndarray  # [B, T] int32, prompt then completion, right-padded with 0
    sampler_logprobs: np.ndarray  # [B, T] float32, 0 on prompt, forced and pad positions
    seq_lens: np.ndarray  # [B] int32, prompt + completion length
    rewards: np.ndarray  # [B] float32, the verifier's reward plus `overlong_penalty`
    group_ids: np.ndarray  # [B] int32, rows sampled from the same prompt share an id
    loss_mask: np.ndarray  # [B, T] bool, sampled (not forced) completion tokens
    overlong_penalty: np.ndarray  # [B] float32, DAPO's length penalty added to the reward (<= 0; 0 when off)
    truncated: np.ndarray  # [B] bool, the completion was cut at the length limit (finish_reason 'length')
    # [B, T, Lm, k] int8 (int16 past 127 experts): the sampler's experts of each sampled token at each MoE layer,
    # -1 (the router's own choice) on prompt, forced and pad positions; None without train.moe.router_replay.
    expert_ids: np.ndarray | None = field(default=None, kw_only=True)

    @staticmethod
    def abstract(batch_size: int, seq_len: int, sharding: Callable[[int], Any] | None = None,
                 routes: tuple[int, int, Any] | None = None) -> RLBatch:
        """ShapeDtypeStructs of a [batch_size, seq_len] batch; `sharding(ndim)` places each leaf (e.g.
        `TrainShardings.batch`). Lets a train step be lowered and compiled without any data. `routes` (Lm, k,
        dtype): the batch carries expert ids (train.moe.router_replay)."""
        def leaf(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, dtype, sharding=None if sharding is None else sharding(len(shape)))

        leaves = {name: leaf((batch_size, seq_len)[:ndim], dtype) for name, (dtype, ndim) in _FIELDS.items()}
        ids = None if routes is None else leaf((batch_size, seq_len, routes[0], routes[1]), routes[2])
        return RLBatch(**leaves, expert_ids=ids)


# dtype and rank of each RLBatch field (what `build_batch` produces).
_FIELDS = {
    "tokens": (np.int32, 2), "sampler_logprobs": (np.float32, 2), "seq_lens": (np.int32, 1),
    "rewards": (np.float32, 1), "group_ids": (np.int32, 1), "loss_mask": (np.bool_, 2),
    "overlong_penalty": (np.float32, 1), "truncated": (np.bool_, 1),
}


# Group ids of filler rows are FILLER - row (each its own group, below every real group's id >= 0).
FILLER = -1


def offset_group_ids(group_ids: np.ndarray, offset: int) -> np.ndarray:
    """A host's group ids made unique across hosts: real ids (>= 0) move up by `offset`, filler ids (< 0) down."""
    ids = np.asarray(group_ids)
    return np.where(ids >= 0, ids + offset, ids - offset).astype(ids.dtype)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_batch(rollouts: Sequence[Rollout], loss_cfg: LossConfig, pad_to_multiple: int = 16,
                seq_len: int | None = None, group_rows: int | None = None) -> RLBatch:
    """Pack groups into a host-local RLBatch. `seq_len` fixes T (else the longest row, rounded up).

    `group_rows` (agent branches kept, whose groups vary in size): every group takes exactly that many rows, its
    completions then filler rows, so that the batch keeps the step's fixed shape. A filler row copies the group's
    last row (finite logits, nothing to mask out of attention) with an empty loss mask and a group id of its own
    below 0 (`FILLER`): group statistics, normalisers and the ESS leave it out (`advantages.keep_sequences`).

    Advantages and loss weights are not computed here: the train step computes them once, over the global batch
    (group statistics and token normalisers must count every host's rows; `step.with_loss_inputs`)."""
    if not rollouts:
        raise ValueError("build_batch needs at least one rollout")
    if group_rows is not None:
        over = [(r.prompt.id, len(r.completions)) for r in rollouts if len(r.completions) > group_rows]
        if over:
            raise ValueError(f"groups {over} have more completions than group_rows={group_rows}")
    rows = [(r, c) for r in rollouts for c in r.completions]
    for r in rollouts:
        if len(r.prompt_tokens) < 1:
            raise ValueError(f"rollout of {r.prompt.id} (data position {r.prompt.position}) has an empty prompt: "
                             "the first completion token would have no context to be scored in")
    longest = max(len(r.prompt_tokens) + len(c.tokens) for r, c in rows)
    T = round_up(longest, pad_to_multiple) if seq_len is None else seq_len
    if longest > T:
        raise ValueError(f"a sequence of {longest} tokens does not fit seq_len={T}")
    B = len(rows) if group_rows is None else group_rows * len(rollouts)
    tokens = np.zeros((B, T), np.int32)
    sampler_lp = np.zeros((B, T), np.float32)
    mask = np.zeros((B, T), bool)
    seq_lens = np.zeros((B,), np.int32)
    rewards = np.zeros((B,), np.float32)
    group_ids = np.zeros((B,), np.int32)
    lengths = np.zeros((B,), np.int32)
    truncated = np.zeros((B,), bool)
    expert_ids = _routes_array(rows, B, T)
    b = 0
    for g, r in enumerate(rollouts):
        r_rewards = r.rewards  # raises on unscored completions
        for c, reward in zip(r.completions, r_rewards):
            p, n = len(r.prompt_tokens), len(c.tokens)
            tokens[b, :p] = r.prompt_tokens
            tokens[b, p:p + n] = c.tokens
            sampler_lp[b, p:p + n] = np.where(c.forced, 0.0, c.logprobs)
            mask[b, p:p + n] = ~np.asarray(c.forced, bool)
            seq_lens[b] = p + n
            rewards[b] = reward
            group_ids[b] = g
            lengths[b], truncated[b] = n, c.finish_reason == "length"
            if expert_ids is not None:
                expert_ids[b, p:p + n] = c.routes
            b += 1
        for _ in range(0 if group_rows is None else group_rows - len(r.completions)):
            tokens[b], seq_lens[b], sampler_lp[b] = tokens[b - 1], seq_lens[b - 1], sampler_lp[b - 1]
            lengths[b], truncated[b], group_ids[b] = lengths[b - 1], truncated[b - 1], FILLER - b
            if expert_ids is not None:
                expert_ids[b] = expert_ids[b - 1]
            b += 1
    penalty = shaping_for(lengths, truncated, loss_cfg)
    rewards = rewards + penalty
    if loss_cfg.overlong_filter:
        mask &= ~truncated[:, None]
    return RLBatch(tokens=tokens, sampler_logprobs=sampler_lp, seq_lens=seq_lens, rewards=rewards,
                   group_ids=group_ids, loss_mask=mask, overlong_penalty=penalty, truncated=truncated,
                   expert_ids=expert_ids)


def _routes_array(rows: Sequence[tuple[Rollout, Any]], B: int, T: int) -> np.ndarray | None:
    """[B, T, Lm, k] of -1 in the completions' route dtype if they carry routes (router replay), else None."""
    routed = [c.routes is not None for _, c in rows]
    if not any(routed):
        return None
    if not all(routed):
        bad = next(r for (r, _), ok in zip(rows, routed) if not ok)
        raise ValueError(f"rollout of {bad.prompt.id} (data position {bad.prompt.position}) has completions without "
                         "expert ids beside others with them (train.moe.router_replay: every sampler must record them)")
    first = next(c.routes for _, c in rows)
    return np.full((B, T, *first.shape[1:]), -1, first.dtype)


def pad_batch(batch: RLBatch, seq_len: int) -> RLBatch:
    """Right-pad every [B, T] field to `seq_len` (hosts must agree on T before their rows become one array)."""
    T = batch.tokens.shape[1]
    if seq_len < T:
        raise ValueError(f"cannot pad a batch of length {T} down to {seq_len}")
    if seq_len == T:
        return batch
    pad = lambda x: np.pad(np.asarray(x), ((0, 0), (0, seq_len - T)))  # noqa: E731
    ids = batch.expert_ids
    if ids is not None:  # padding routes freely
        ids = np.pad(np.asarray(ids), ((0, 0), (0, seq_len - T), (0, 0), (0, 0)), constant_values=-1)
    return replace(batch, tokens=pad(batch.tokens), sampler_logprobs=pad(batch.sampler_logprobs),
                   loss_mask=pad(batch.loss_mask), expert_ids=ids)


def combine_host_metrics(per_host: Sequence[HostMetrics]) -> HostMetrics:
    """Host metrics from every host -> one dict: `_min` by min, `_max` by max, `_mean` by mean (hosts hold
    equal shares of the batch), anything else (counts) by sum."""
    out: HostMetrics = {}
    for k in per_host[0]:
        vals = [float(m[k]) for m in per_host]
        if k.endswith("_min"):
            out[k] = min(vals)
        elif k.endswith("_max"):
            out[k] = max(vals)
        elif k.endswith("_mean"):
            out[k] = float(np.mean(vals))
        else:
            out[k] = float(sum(vals))
    return out
