"""Tokens the engine forces instead of sampling: EOS at the length limit, and the reasoning-budget phrase.

Both return a `forced` mask so the loss can keep tokens the policy did not choose out of the gradient (the
blog's versions don't mark them). All shapes are fixed; `index` is where the new token will be written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp


def force_eos(
    token: jax.Array,  # [B]
    logprob: jax.Array,  # [B]
    forced: jax.Array,  # [B] bool
    index: jax.Array,  # [B] position the token is written at (0-based, counting the prompt)
    *,
    limit: jax.Array | int,  # [B] or scalar: total length allowed (max_seq_len, or prompt + max_new_tokens + 1)
    eos_id: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Returns (token, logprob, forced, stop, hit_length). The last slot (index == limit-1) always gets EOS with
    logprob 0, so every finished row ends in EOS and fits its limit."""
    hit_length = index + 1 >= limit
    sampled_eos = token == eos_id
    length_forced = hit_length & ~sampled_eos
    token = jnp.where(hit_length, eos_id, token)
    logprob = jnp.where(length_forced, 0.0, logprob)
    return token, logprob, forced | length_forced, sampled_eos | hit_length, length_forced


def force_end_of_think(
    token: jax.Array,  # [B]
    logprob: jax.Array,  # [B]
    end_of_think: jax.Array,  # [B] bool: the row has already closed its thinking
    index: jax.Array,  # [B]
    prompt_len: jax.Array,  # [B]
    *,
    budget: int,
    phrase: Sequence[int],
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Insert `phrase` (ending in the end-of-think token) so that it ends exactly at `budget` completion tokens.

    Completion position c = index - prompt_len. Phrase token t is written at c == budget - len(phrase) + t, for
    rows that have not ended thinking on their own. Returns (token, logprob, forced, end_of_think)."""
    n = len(phrase)
    think_id = int(phrase[-1])
    c = index - prompt_len
    forced = jnp.zeros_like(end_of_think)
    new_token = token
    for t, tok in enumerate(phrase):
        hit = (c == budget - n + t) & ~end_of_think
        new_token = jnp.where(hit, int(tok), new_token)
        forced = forced | hit
    logprob = jnp.where(forced, 0.0, logprob)
    end_of_think = end_of_think | (new_token == think_id)
    return new_token, logprob, forced, end_of_think


def think_phrase(tokenizer: Any, phrase: str, budget: int) -> list[int]:
    """`inference.think_phrase` as ids, checked: it must end with the tokenizer's end-of-think token and fit in the
    reasoning budget."""
    if tokenizer is None:
        raise ValueError("inference.reasoning_budget needs a tokenizer to encode inference.think_phrase")
    ids = tokenizer.encode(phrase)
    eot = tokenizer.end_of_think_id
    if eot is None or not ids or ids[-1] != eot:
        raise ValueError(
            f"inference.think_phrase={phrase!r} must end with the tokenizer's end-of-think token"
            f" (id {eot}); this tokenizer has {'none' if eot is None else 'a different last token'}"
        )
    if len(ids) > budget:
        raise ValueError(f"inference.think_phrase is {len(ids)} tokens, longer than inference.reasoning_budget")
    return ids
