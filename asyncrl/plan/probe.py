"""The decode step's cost at other batch sizes, measured on this machine.

A replica's decode program is compiled once for `inference.max_decode_batch_size` rows and runs all of them at
every step, live or not, so a run measures its decode step at one batch size only: its occupancy hardly varies
(a busy replica keeps its batch full), and nothing in its logs says what a step of half or twice the rows costs.
A what-if that changes the batch needs that cost, and it depends on the machine (a step's fixed share, the weight
read, against its per-row share), so it is measured here: the run's model (random weights of its shapes: the cost
does not depend on the values) in the run's inference settings, at each batch size, on this machine's default
device. Only the ratio between batch sizes is used (`from_run.decode_at_batch`): the run's fitted costs carry the
level, and the contention it ran under.

What is timed is a busy replica's decode: 4 x B prompts, each sampled to the longest completion its context
allows (never stopping early: the end-of-sequence id is outside the vocabulary), and the engine's decode seconds
over its decode steps. That is a step with its share of the calls around it: a busy replica takes in one row per
call and its rows end one step apart, so its calls and steps come in a fixed proportion, and a run's fit cannot
tell the two apart either. Summed over passes for `budget_s` seconds (at least `repeats`) at each batch size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from asyncrl.config.schema import Config


def decode_step_seconds(cfg: Config, batches: Sequence[int], prompt_len: int, repeats: int = 3, budget_s: float = 3.0,
                        log: Callable[[str], None] | None = None) -> dict[int, float]:
    """Seconds per decode step of `cfg`'s model and inference settings (a `Config`) at each batch size."""
    import jax

    from asyncrl.inference.engine import Engine, Request
    from asyncrl.models import Model
    from asyncrl.models.sources import model_config
    from asyncrl.rollout import Prompt

    inf = cfg.inference
    prompt_len = max(1, min(int(prompt_len), inf.max_seq_len // 2))
    new = inf.max_seq_len - prompt_len - 1  # the forced EOS takes the last position
    if new < 4:
        raise ValueError(f"plan: inference.max_seq_len={inf.max_seq_len} leaves too few decode steps past a "
                         f"{prompt_len}-token prompt to time a step")
    model = Model(model_config(cfg.model))
    params = model.init_params(jax.random.PRNGKey(0), jax.numpy.dtype(inf.params_dtype))
    eos = model.cfg.vocab_size  # never sampled: every row decodes exactly its max_new_tokens
    rng = np.random.default_rng(0)
    out: dict[int, float] = {}
    for b in sorted(set(int(x) for x in batches)):
        t0 = time.perf_counter()
        eng = Engine(model, params, replace(inf, max_decode_batch_size=b, max_new_tokens=new,
                                            max_prefill_prompts=min(inf.max_prefill_prompts, b)), None, eos_id=eos)
        prompts = [rng.integers(3, model.cfg.vocab_size - 1, size=prompt_len).tolist() for _ in range(4 * b)]

        def decode() -> tuple[float, int]:
            s0, d0 = eng.stats.decode_time, eng.stats.decode_steps
            eng.generate([Request(Prompt(i), p) for i, p in enumerate(prompts)], drain=True)
            return eng.stats.decode_time - s0, eng.stats.decode_steps - d0

        decode()  # compile
        secs = steps = 0.0
        passes, start = 0, time.perf_counter()
        while passes < repeats or time.perf_counter() - start < budget_s:
            s, k = decode()
            secs, steps, passes = secs + s, steps + k, passes + 1
        out[b] = secs / steps
        if log:
            log(f"  decode step at batch {b}: {1e3 * out[b]:.3f} ms ({passes} passes, "
                f"{time.perf_counter() - t0:.1f} s)")
    return out
