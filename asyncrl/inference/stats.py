"""An engine's counters: what the inference worker reports and the benchmarks print (`EngineStats`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    decode_steps: int = 0
    calls: int = 0
    finished: int = 0
    generated_tokens: int = 0
    decode_time: float = 0.0  # seconds of decode loops, dispatch to device completion
    prefill_time: float = 0.0  # seconds of prefills, dispatch to device completion
    prefill_calls: int = 0
    engine_time: float = 0.0  # wall seconds inside generate / advance: the device calls and the host work between
    extend_time: float = 0.0  # seconds of extends (multi-turn continuations)
    env_steps: int = 0
    env_time: float = 0.0  # seconds environments spent in their steps (on worker threads)
    parked_full: int = 0  # continuations whose cache did not fit the park store (re-prefilled)
    slot_steps: int = 0  # decode steps x rows live in them (occupancy: slot_steps / (decode_steps x batch)); the
    # row-steps that fed an observation token rather than sampling one are `fed_tokens`
    slot_time: float = 0.0  # decode seconds x rows live in them
    fed_tokens: int = 0  # observation tokens fed by decode steps (multi-turn continuations)
    park_time: float = 0.0  # seconds of park calls (a row's cache into the park store)
    extend_calls: int = 0
    extend_rows: int = 0  # continuations extended (over extend_calls: rows a call)
    detokenize_time: float = 0.0  # seconds collecting finished rows on the host (detokenizing them)
