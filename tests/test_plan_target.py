"""`launch.py plan --config-name`: the pipeline model fed by `launch.py aot`. The program times it takes from the
aot rows are checked against hand counts on rows made here, then the whole command runs on the tpu_tiny preset:
it compiles the programs for v5p, sweeps the split and max_lag, marks the best point and draws the plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from asyncrl.aot.roofline import CHIPS
from asyncrl.config.loader import load_config
from asyncrl.models.sources import model_config
from asyncrl.plan.target import Assumptions, PlanError, Target, sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(program, chips, roofline_s, tokens=0, seq_len=0, role="inference", fits=True, peak=1e9):
    return {"program": program, "topology": "v5p:2x4x4", "role": role, "chips": chips, "per": "call", "tokens": tokens,
            "seq_len": seq_len, "fits": fits, "peak_bytes_per_chip": peak, "hbm_bytes_per_chip": 95e9,
            "roofline_s": roofline_s, "error": None}


def _rows(train_chips=4, train_tokens=128 * 32, train_peak=30e9):
    return [_row("train_step", train_chips, 2.0, train_tokens, 32, "trainer", peak=train_peak),
            _row("weight_sync_cast", train_chips, 0.01, role="trainer"),
            _row("decode", 1, 0.02, 32, 32),
            _row("prefill[16]", 1, 0.05, 8 * 16, 16), _row("prefill[32]", 1, 0.09, 8 * 32, 32)]


def _target(*overrides, rows=None, **assume):
    cfg = load_config("tpu_tiny", ["run.hosts=8", "async.train_workers=2", *overrides])
    return Target.of(cfg, rows or _rows(), Assumptions(**assume))


def test_program_times_are_the_compiled_rooflines_over_the_efficiency():
    t = _target(efficiency=0.5)
    times = t.times(2)  # the compiled trainer: 2 hosts x 2 chips
    assert times.decode_step(1) == times.decode_step(32) == pytest.approx(0.04)  # fixed shape: rows cost nothing
    assert times.prefill(8 * 16) == pytest.approx(0.1)  # tpu_tiny prompts: min_prefill_bucket 16 -> prefill[16]
    assert times.train_step(1) == times.train_step(10 ** 6) == pytest.approx(4.0)
    assert times.sync_cast_s == pytest.approx(0.02)
    # Another trainer size: scaled by chips (4 chips compiled, 8 here); another batch: by tokens.
    assert t.times(4).train_step(0) == pytest.approx(2.0)
    assert _target("train.train_batch_size=256", efficiency=0.5).times(2).train_step(0) == pytest.approx(8.0)
    # A longer prompt takes the next bucket; one past every bucket is an error naming prompt_len.
    assert _target(prompt_len=20, efficiency=0.5).times(2).prefill(0) == pytest.approx(0.18)
    with pytest.raises(PlanError, match="prompt_len=40"):
        _target(prompt_len=40).times(2)


def test_the_hop_chain_is_the_bytes_over_one_link_pipelined_past_two_slots():
    cfg = load_config("tpu_tiny")
    full = model_config(cfg.model).num_params() * 2  # bf16 inference weights, tp 1
    link = CHIPS["v5p"].link_bandwidth
    t = _target("weightsync.bucket_mb=0.001")
    assert t.sync_bytes() == full
    assert t.sync_transfer_s(4) == pytest.approx(full / link)  # 2 slots: one hop
    # 4 slots (train_workers 2 of 8 hosts): one whole transfer, then a bucket per further hop.
    assert t.sync_transfer_s(2) == pytest.approx(full / link + 2 * min(1e3 / link, full / link))
    store_and_forward = _target("weightsync.bucket_mb=0")
    assert store_and_forward.sync_transfer_s(2) == pytest.approx(3 * full / link)
    lora = _target("train.lora.rank=4", "train.lora.freeze_a=true")
    assert 0 < lora.sync_bytes() < full / 10


def test_splits_are_the_ones_the_hop_chain_allows_and_memory_is_scaled_by_chips():
    t = _target(rows=_rows(train_peak=60e9))  # 8 hosts, 16 prompts per step; compiled on 4 chips
    assert t.train_workers_options() == [1, 2, 4]
    assert [t.fits(tw) for tw in (1, 2, 4)] == [False, True, True]  # 120 GB per chip on 2 chips; 60; 30 (of 95)
    assert t.replicas(2) == 6 * 2  # 6 inference hosts of 2 chips, a replica per chip (tp 1)
    assert _target("inference.replica_mode=spmd").replicas(2) == 6  # one SPMD replica per inference host
    with pytest.raises(PlanError, match="decode"):
        Target.of(t.cfg, [r for r in _rows() if r["program"] != "decode"], Assumptions())


def test_the_sweep_marks_the_fastest_fitting_point_and_a_longer_lag_lets_inference_run_ahead():
    t = _target(steps=14, skip_steps=3, tail=0.8)
    points = sweep(t, lags=(0, 2))
    assert len(points) == 3 * 2
    best = [p for p in points if p.best]
    assert len(best) == 1 and best[0].fits
    assert best[0].result.step_s == min(p.result.step_s for p in points if p.fits)
    for tw in (1, 2, 4):
        lag0, lag2 = (next(p for p in points if p.train_workers == tw and p.max_lag == lag) for lag in (0, 2))
        assert lag2.result.step_s < lag0.result.step_s
        assert lag0.result.dropped_lag == 0


def test_launch_plan_on_a_preset_compiles_predicts_sweeps_and_plots(tmp_path):
    png, out = tmp_path / "plan.png", tmp_path / "plan.json"
    res = subprocess.run([sys.executable, "launch.py", "plan", "--config-name", "tpu_tiny", "--lags", "0", "1",
                          "--steps", "12", "--png", str(png), "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "compiling train_step over 2 v5p chips" in res.stderr
    assert "as configured (train_workers 1, max_lag 1)" in res.stdout and "<- best" in res.stdout
    assert "closed-form roofline split" in res.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(out.read_text())
    assert [(p["train_workers"], p["max_lag"]) for p in data["points"]] == [(1, 0), (1, 1)]
    assert sum(p["best"] for p in data["points"]) == 1
    assert all(p["step_s"] > 0 and 0 <= p["trainer_busy"] <= 1 for p in data["points"])
    bad = subprocess.run([sys.executable, "launch.py", "plan", "--config-name", "tpu_tiny", "--from-aot",
                          str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "neither the rows of `launch.py aot --out`" in bad.stderr
