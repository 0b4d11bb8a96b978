"""Where step metrics go: RUN_DIR/metrics.jsonl, tensorboardX (RUN_DIR/tb), Ray Gauges (dashboard), the driver's
progress (`progress.py`), and at the end a summary table and RUN_DIR/reward_curve.png."""

from __future__ import annotations

import math
import os
import time
from typing import Any

from asyncrl.orchestration import jsonl
from asyncrl.orchestration.messages import InferenceReport
from asyncrl.orchestration.progress import Progress


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def inference_means(reports: list[InferenceReport]) -> dict[str, float]:
    """The inference hosts' reports since the last step -> `inference/<key>`: the mean of each key (the max of
    `*_max` keys)."""
    rows = [r.metrics() for r in reports]
    out: dict[str, float] = {}
    for key in rows[0] if rows else ():
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if vals:
            out[f"inference/{key}"] = max(vals) if key.endswith("_max") else sum(vals) / len(vals)
    return out


class RayGauges:
    """One Ray Gauge per metric key, created lazily; they show in the Ray dashboard's metrics view."""

    def __init__(self, run_name: str):
        from ray.util.metrics import Gauge

        self._Gauge = Gauge
        self._gauges: dict[str, Any] = {}
        self._tags = {"run": run_name}

    def set(self, metrics: dict[str, Any]) -> None:
        for k, v in metrics.items():
            if not _finite(v):
                continue
            name = "asyncrl_" + "".join(c if c.isalnum() else "_" for c in k)
            g = self._gauges.get(name)
            if g is None:
                g = self._gauges[name] = self._Gauge(name, description=f"asyncrl metric {k}", tag_keys=("run",))
            g.set(float(v), tags=self._tags)


class MetricsSink:
    """Driver-side writer. `resume_from` drops lines past the checkpoint step so no step appears twice (and a torn
    last line with them: `jsonl`)."""

    def __init__(self, run_dir: str, tensorboard: bool = True, progress: Progress | None = None,
                 resume_from: int | None = None):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, "metrics.jsonl")
        os.makedirs(run_dir, exist_ok=True)
        jsonl.truncate(self.path, lambda r: resume_from is None or r.get("step", 0) <= resume_from)
        self.rows: list[dict[str, Any]] = jsonl.read(self.path)
        self.tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(os.path.join(run_dir, "tb"))
        self.progress = progress
        self.t0 = time.time()

    def write(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        self.rows.append(row)
        jsonl.append(self.path, [row])
        if self.tb is not None:
            for k, v in row.items():
                if _finite(v) and k != "step":
                    self.tb.add_scalar(k.replace("@", "_at_"), v, step)  # '@' is not a legal summary name
            self.tb.flush()
        if self.progress is not None:
            self.progress.update(row)

    def eval_points(self) -> list[tuple[int, float]]:
        return [(int(r.get("eval/at_step", r["step"])), float(r["eval/reward_mean"]))
                for r in self.rows if _finite(r.get("eval/reward_mean"))]

    def summary(self) -> str:
        if not self.rows:
            return "no steps were recorded"
        last = self.rows[-1]
        lines = ["", "asyncrl run summary", "-" * 44, f"{'steps':<28}{last['step']:>16}"]
        evals = self.eval_points()
        if evals:
            lines.append(f"{'eval reward before RL':<28}{evals[0][1]:>16.3f}  (step {evals[0][0]})")
            lines.append(f"{'eval reward after RL':<28}{evals[-1][1]:>16.3f}  (step {evals[-1][0]})")
        for key in ("eval/pass@1", "rollout/reward_mean", "train/loss", "rollout/lag_max", "rollout/filtered_lag",
                    "weight_sync_s", "weight_sync/trainer_blocked_s", "train/tokens_per_s",
                    "inference/decode_tokens_per_s", "rollout/queue_wait_s_max"):
            vals = [r[key] for r in self.rows if _finite(r.get(key))]
            if vals:
                lines.append(f"{key:<28}{vals[-1]:>16.4g}  (mean {sum(vals) / len(vals):.4g})")
        lines.append(f"{'wall time (s)':<28}{time.time() - self.t0:>16.1f}")
        return "\n".join(lines)

    def plot(self) -> str | None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        train = [(r["step"], r["rollout/reward_mean"]) for r in self.rows if _finite(r.get("rollout/reward_mean"))]
        evals = self.eval_points()
        if not train and not evals:
            return None
        fig, ax = plt.subplots(figsize=(7, 4))
        if train:
            ax.plot(*zip(*train), label="train reward (rollouts)", alpha=0.7)
        if evals:
            ax.plot(*zip(*evals), "o-", label="held-out eval reward")
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward")
        # The task's reward range, [0, 1], from zero; widened only if a reward (a user's environment's) falls outside.
        ys = [y for _, y in train + evals]
        ax.set_ylim(min(-0.02, min(ys) - 0.02), max(1.02, max(ys) + 0.02))
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(os.path.basename(os.path.abspath(self.run_dir)))
        path = os.path.join(self.run_dir, "reward_curve.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.tb is not None:
            self.tb.close()
