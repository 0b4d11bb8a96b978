"""Config of the weight sync (`weightsync:` in YAML)."""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.validate import check


@dataclass(frozen=True)
class WeightSyncConfig:
    bucket_mb: float = 512.0
    """Pipelining granularity of the hop chain, in MB (1e6 bytes): each hop forwards bucket i while it receives
    bucket i+1, so a chain of n slots costs about one whole transfer plus (n - 2) buckets. A leaf larger than a
    bucket is cut along its first (stacked layer) axis. Only chains of 3+ slots use buckets (one hop has nothing to
    overlap). 0 sends the whole tree as one bucket (store-and-forward: n - 1 whole transfers in a row). The default
    suits TPU links (~1 ms per bucket-hop of fixed cost against ~5 ms to move 512 MB over one v5p ICI link);
    simulated hosts sharing one machine's cores are better off with 0 (benchmarks/README.md, weight_sync)."""
    overlap: bool = True
    """The trainer starts its next step while its previous weights travel (its inference-dtype copy is a separate
    buffer, kept alive until the sync is done). It blocks only when the next sync is due before the previous one
    finished, and before an eval round (which must see the step's weights); `weight_sync/trainer_blocked_s` is that
    time. False: every sync blocks the trainer until the weights have landed."""
    timeout_s: float = 600.0
    """Longest any process waits at the barriers that open and close a sync (every process of the job meets there:
    a dead or wedged host turns into an error naming the sync instead of a hang), and longest a receiving host
    waits for one bucket of a hop to arrive."""
    first_sync_timeout_s: float = 1800.0
    """Longest an inference host waits for its first weights: the trainer sends them once it is built (the model
    loaded, any format warm-start done, the programs compiled), so this is generous; it bounds a trainer that never
    comes up."""

    def __post_init__(self) -> None:
        check("weightsync.bucket_mb", self.bucket_mb, self.bucket_mb >= 0, ">= 0 (0 = one bucket)")
        check("weightsync.timeout_s", self.timeout_s, self.timeout_s > 0, "> 0")
        check("weightsync.first_sync_timeout_s", self.first_sync_timeout_s, self.first_sync_timeout_s > 0, "> 0")
