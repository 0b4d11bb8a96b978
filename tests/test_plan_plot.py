"""`launch.py plan`'s PNG (`asyncrl/plan/target.py` `plot`): every y axis starts at zero and holds all its points,
so a 3% difference in step time between splits reads as 3%, not as a cliff across the panel."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402

from asyncrl.config.loader import load_config  # noqa: E402
from asyncrl.plan.target import Assumptions, Target, plot, sweep  # noqa: E402


def _row(program, chips, roofline_s, tokens=0, seq_len=0, role="inference"):
    return {"program": program, "topology": "v5p:2x4x4", "role": role, "chips": chips, "per": "call", "tokens": tokens,
            "seq_len": seq_len, "fits": True, "peak_bytes_per_chip": 1e9, "hbm_bytes_per_chip": 95e9,
            "roofline_s": roofline_s, "error": None}


def test_both_panels_draw_step_time_and_tokens_per_s_from_zero(tmp_path, monkeypatch):
    rows = [_row("train_step", 4, 2.0, 128 * 32, 32, "trainer"), _row("weight_sync_cast", 4, 0.01, role="trainer"),
            _row("decode", 1, 0.02, 32, 32), _row("prefill[16]", 1, 0.05, 8 * 16, 16),
            _row("prefill[32]", 1, 0.09, 8 * 32, 32)]
    cfg = load_config("tpu_tiny", ["run.hosts=8", "async.train_workers=2"])
    target = Target.of(cfg, rows, Assumptions(steps=10, skip_steps=2))
    points = sweep(target, lags=(0, 1, 2))
    saved: list[Figure] = []
    real_savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: (saved.append(fig), real_savefig(fig, *a, **kw)))
    png = tmp_path / "plan.png"
    plot(points, target, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = saved
    assert len(fig.axes) == 4  # two panels, each with its step-time axis and its tokens/s twin
    for ax in fig.axes:
        ys = [y for line in ax.get_lines() for y in line.get_ydata()]
        lo, hi = ax.get_ylim()
        assert ys and lo == 0 and max(ys) <= hi, (ax.get_ylabel(), lo, hi, ys)
        assert min(ys) > 0.2 * hi  # the axis is fitted to the data above zero, not stretched to nothing
