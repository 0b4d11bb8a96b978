"""The blog's roofline split, checked against its own worked example (Llama 8B on 32 v5p chips)."""

from __future__ import annotations

import json

import pytest

from asyncrl.aot.roofline import CHIPS, RooflineError, roofline, valid_train_workers
from asyncrl.cli.roofline import main

BLOG = dict(
    params=8e9,
    kv_bytes_per_token=4 * 32 * 8 * 128,
    seq_len=4096,
    decode_batch=44,
    rollout_fraction=0.5,
    chip_flops=459e12,
    chip_bandwidth=2765e9,
    chips=32,
)
BLOG_PRESET_ARGS = [
    "--model", "llama-3.1-8b", "--chip", "v5p", "--chips", "32",
    "--seq-len", "4096", "--decode-batch", "44", "--rollout-fraction", "0.5",
]


def test_blog_example() -> None:
    res = roofline(**BLOG)
    assert 1.4 < res.r < 1.65
    assert 0.37 < res.train_share < 0.42
    assert res.train_share == pytest.approx(1 / (1 + res.r))
    assert res.train_chips + res.inference_chips == 32
    assert abs(res.train_chips - res.ideal_train_chips) < 1
    assert res.hosts is None and res.train_workers is None


def test_formula_pieces_and_balance() -> None:
    res = roofline(**BLOG)
    lam, c, m, k, t, p, bd = 0.5, 459e12, 2765e9, 131072, 4096, 8e9, 44
    assert res.r == pytest.approx(lam * c / (6 * m) * (k * t / p + 2 / bd))
    assert res.r == pytest.approx(res.inference_chip_seconds_per_sequence / res.train_chip_seconds_per_sequence)
    # At the fractional optimum both sides take the same time, so the integer split cannot beat it.
    assert 0.9 < res.chip_split.efficiency <= 1.0
    alpha, beta = res.train_chip_seconds_per_sequence, res.inference_chip_seconds_per_sequence
    for x in range(1, 32):
        assert 1 / max(alpha / x, beta / (32 - x)) <= res.chip_split.sequences_per_second * (1 + 1e-12)


def test_more_decode_batch_means_more_training_chips() -> None:
    small = roofline(**{**BLOG, "decode_batch": 8})
    large = roofline(**{**BLOG, "decode_batch": 128})
    assert large.train_share > small.train_share


def test_host_split_respects_weight_sync_divisibility() -> None:
    res = roofline(**BLOG, chips_per_host=4)
    assert res.hosts == 8
    assert res.host_split is not None and res.valid_host_split is not None
    assert res.host_split.train_hosts == 3  # nearest whole-host split to 12.5 chips
    assert res.train_workers == 4  # 3 does not divide 8; 4 beats 2 (the blog ran 50/50)
    assert 8 % res.train_workers == 0
    assert res.valid_host_split.train_chips == 16
    assert valid_train_workers(8) == [1, 2, 4]
    assert valid_train_workers(2) == [1]


def test_single_host_warns_and_skips_host_split() -> None:
    res = roofline(**{**BLOG, "chips": 8}, chips_per_host=8)
    assert res.hosts == 1 and res.host_split is None and res.train_workers is None
    assert any("2 hosts" in w for w in res.warnings)


def test_hbm_fit_warning() -> None:
    ok = roofline(**BLOG, chip_hbm_bytes=CHIPS["v5p"].hbm_bytes)
    assert ok.max_decode_batch is not None and ok.max_decode_batch >= 44
    assert not any("does not fit" in w for w in ok.warnings)
    too_big = roofline(**{**BLOG, "decode_batch": 1024}, chip_hbm_bytes=CHIPS["v5p"].hbm_bytes)
    assert any("does not fit" in w for w in too_big.warnings)


@pytest.mark.parametrize(
    "field,value",
    [("chips", -4), ("chips", 1), ("rollout_fraction", 0.0), ("rollout_fraction", 1.5), ("params", -1.0),
     ("seq_len", 0), ("decode_batch", 2.5), ("chip_bandwidth", float("inf"))],
)
def test_bad_inputs_name_the_field(field: str, value: float) -> None:
    with pytest.raises(RooflineError, match=field) as info:
        roofline(**{**BLOG, field: value})
    assert info.value.field == field


def test_chips_must_fill_whole_hosts() -> None:
    with pytest.raises(RooflineError, match="whole number of hosts"):
        roofline(**{**BLOG, "chips": 30}, chips_per_host=4)


def test_v6e_layout() -> None:
    assert CHIPS["v6e"].chips_per_host_for(8) == 8  # v6e-8: one VM
    assert CHIPS["v6e"].chips_per_host_for(64) == 4  # multi-host v6e slices
    assert CHIPS["v6e"].chips_per_host_for(4) == 4
    assert CHIPS["v5p"].chips_per_host_for(32) == 4


def test_cli_presets_match_blog(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(BLOG_PRESET_ARGS + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 8.0e9 < out["params"] < 8.1e9  # the real Llama-3.1-8B count, not the blog's rounded 8e9
    assert out["kv_bytes_per_token"] == 131072
    assert 1.4 < out["r"] < 1.65 and 0.37 < out["train_share"] < 0.42
    assert out["chips_per_host"] == 4 and out["hosts"] == 8 and out["train_workers"] == 4
    assert out["train_chips"] + out["inference_chips"] == 32


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(BLOG_PRESET_ARGS) == 0
    out = capsys.readouterr().out
    for needle in ("r (decode / train work)", "train share X/A", "39.", "train / inference", "async.train_workers"):
        assert needle in out


def test_cli_explicit_flags_override_presets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(BLOG_PRESET_ARGS + ["--params", "8e9", "--chip-bandwidth", "5530e9", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == 8e9
    assert out["chip_bandwidth"] == 5530e9
    base = roofline(**BLOG)
    assert out["r"] == pytest.approx(base.r / 2)  # twice the bandwidth halves the decode work


def test_cli_raw_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in BLOG.items()] + ["--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["r"] == pytest.approx(roofline(**BLOG).r)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (BLOG_PRESET_ARGS[:-2], "--rollout-fraction"),
        (["--chip", "v5p", "--chips", "32", "--seq-len", "4096", "--decode-batch", "44", "--rollout-fraction", "0.5"],
         "--params (or --model)"),
        ([a if a != "32" else "-4" for a in BLOG_PRESET_ARGS], "--chips"),
        (BLOG_PRESET_ARGS + ["--chip", "tpu-v99"], "known chips"),
        (BLOG_PRESET_ARGS + ["--model", "gpt-9"], "known models"),
        (BLOG_PRESET_ARGS + ["--chips-per-host", "0"], "--chips-per-host"),
    ],
)
def test_cli_errors_are_clear(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err
