"""The messages between the trainer and inference roles, as small typed records rather than dicts whose keys a
reader has to guess (PipelineRL's `WeightUpdateSuccess`, `SamplesProcessed`). Prompts and rollouts travel as the
records of `asyncrl/rollout.py`; metric rows to the driver stay plain dicts (they are open-ended by design).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WeightSync:
    """Trainer rank 0 -> each inference host ('weight_sync' queue): park the replicas; the weights of `version`
    come through the hop chain next. The chain's barriers are named after the version on both ends
    (`HopChainTransfer.prepare(..., version=)`), so a host can only ever receive the weights it was told of: on a
    mismatch each side times out naming the version it waited for, never taking one version's weights for
    another's."""

    version: int
    full: bool = True
    """With LoRA, whether the base travels too (a receiver's first sync of the attempt) or only the adapters."""


@dataclass(frozen=True)
class GroupConsumed:
    """A trainer rank > 0 -> the prompt feeder on rank 0 ('consumed' queue): the group at data `position` was
    trained (`reason` None) or dropped ("lag", "zero_variance"). Rank 0 credits its own groups directly."""

    position: int
    reason: str | None
    rank: int


@dataclass(frozen=True)
class InferenceReport:
    """An inference host -> trainer rank 0 ('inference_metrics' queue), every couple of seconds per replica; the
    step row carries their means as `inference/<key>`."""

    host: str
    decode_tokens_per_s: float
    finished: float
    decode_steps: float
    version: float
    in_flight: float
    prefill_s: float
    extra: dict[str, float] = field(default_factory=dict)
    """Keys without a field of their own: the last weight sync's timings (`weight_sync_park_s`, ...)."""
    counters: dict[str, float] = field(default_factory=dict)
    """The replica's cumulative counters and the wall time they were read at (`t`), written to the run's
    `inference.jsonl` for `launch.py plan --from-run`, not averaged into the step rows."""

    def metrics(self) -> dict[str, float]:
        fixed = {k: getattr(self, k) for k in ("decode_tokens_per_s", "finished", "decode_steps", "version",
                                               "in_flight", "prefill_s")}
        return {**fixed, **self.extra}
