"""Temperature sampling, and THE definition of a sampler logprob.

Logprob semantics (shared with the trainer, see `asyncrl/ops/logprobs.py`):
    logprob(token) = log_softmax(logits / temperature)[token]      for temperature > 0
    logprob(token) = log_softmax(logits)[token]                    for temperature == 0 (greedy: argmax)
i.e. the log-probability under the distribution the token was actually drawn from. The trainer recomputes the
same quantity by scaling its final hidden state by 1/temperature before the LM head, so sampler and trainer
agree up to numerics, and importance ratios are exactly 1 when the weights are the same.
Forced tokens (length EOS, reasoning-budget phrase) get logprob 0 and are marked; see forcing.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(logits: jax.Array, keys: jax.Array, temperature: float) -> tuple[jax.Array, jax.Array]:
    """logits: [B, V] fp32, keys: [B, 2] one PRNG key per row -> (tokens [B] int32, logprobs [B] fp32).

    Per-row keys make a sample depend only on (seed, prompt uid, sample index, position) and the weights, not
    on which replica or batch slot it ran in: runs are reproducible across replica counts and resumes."""
    logits = logits.astype(jnp.float32)
    if temperature > 0:
        scaled = logits / temperature
        tokens = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, scaled).astype(jnp.int32)
    else:
        scaled = logits
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # A masked sum instead of a gather: it stays a plain reduction when the vocab is split over a tp axis.
    pick = jnp.arange(scaled.shape[-1])[None, :] == tokens[:, None]
    logprobs = jnp.sum(jnp.where(pick, jax.nn.log_softmax(scaled, axis=-1), 0.0), axis=-1)
    return tokens, logprobs
