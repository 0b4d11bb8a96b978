"""The driver's console: one live progress bar on a terminal, plain lines every N steps anywhere else.

On a TTY the bar (tqdm, on stderr) shows the step, the rollout reward, the last eval, the lag, train tokens/s
and the ETA, redrawn in place. Without one (CI, `ray job logs`, a pipe) a bar would be a stream of carriage
returns, so a plain line is printed every `every` steps and at the last.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, TextIO


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _fmt_duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def _fmt_rate(v: float) -> str:
    return f"{v / 1e3:.1f}k" if v >= 1e3 else f"{v:.0f}"


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # not a file, or not a terminal
        return 0


class Progress:
    """`update(row)` with every published step's metrics row; `close()` before printing the summary."""

    def __init__(self, total: int, initial: int = 0, every: int = 10, stream: TextIO | None = None,
                 tty: bool | None = None):
        self.total, self.every = total, max(1, every)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.last_eval: float | None = None
        self.initial = initial
        self.t0 = time.monotonic()
        self.bar: Any = None
        self.closed = False

    def _open_bar(self) -> Any:
        """The bar appears with the first step, below the hosts' start-up lines (a bar drawn earlier would have
        them appended to its line)."""
        from tqdm import tqdm

        # Follow the terminal's size; a terminal that reports none (a bare pty: 0 x 0) gets 100 x 24, since tqdm
        # draws nothing on a screen of 0 rows.
        sized = _columns(self.stream) > 0
        return tqdm(total=self.total, initial=self.initial, file=self.stream, unit="step", dynamic_ncols=sized,
                    ncols=None if sized else 100, nrows=None if sized else 24, smoothing=0.1,
                    # the fields go in `desc`, which tqdm prints as given ({postfix} would gain a ", ")
                    bar_format="asyncrl {n_fmt}/{total_fmt} |{bar}| {desc} [{elapsed}<{remaining}]")

    def fields(self, row: dict[str, Any]) -> list[str]:
        """The short `name value` parts shown for a row (bar postfix and plain line alike)."""
        if _finite(row.get("eval/reward_mean")):
            self.last_eval = float(row["eval/reward_mean"])
        parts = []
        if _finite(row.get("rollout/reward_mean")):
            parts.append(f"reward {row['rollout/reward_mean']:.3f}")
        if self.last_eval is not None:
            parts.append(f"eval {self.last_eval:.3f}")
        if _finite(row.get("rollout/lag_mean")):
            parts.append(f"lag {row['rollout/lag_mean']:.2f}")
        if _finite(row.get("train/tokens_per_s")):
            parts.append(f"tok/s {_fmt_rate(row['train/tokens_per_s'])}")
        return parts

    def update(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        parts = self.fields(row)
        if self.tty:
            if self.closed:
                return
            if self.bar is None:
                self.bar = self._open_bar()
            self.bar.set_description_str(" | ".join(parts), refresh=False)
            self.bar.update(step - self.bar.n)
            return
        if step % self.every and step != self.total:
            return
        elapsed = time.monotonic() - self.t0
        done = step - self.initial
        eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
        timing = f"{_fmt_duration(elapsed)} elapsed" + (f", ETA {_fmt_duration(eta)}" if math.isfinite(eta) else "")
        print(" | ".join([f"[asyncrl] step {step}/{self.total}", *parts, timing]), file=self.stream, flush=True)

    def close(self) -> None:
        self.closed = True
        if self.bar is not None:
            self.bar.close()
            self.bar = None
