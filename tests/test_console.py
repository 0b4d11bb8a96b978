"""The driver's console: the progress bar on a terminal, plain lines every N steps elsewhere, and the INFO / DEBUG
split (per-sync lines only at DEBUG). The unit tests drive `Progress` directly; the slow one runs real local jobs
through `launch.py`, one in a pseudo-terminal and one on a pipe, and counts what they print."""

import io
import os
import re
import subprocess
import sys

import pytest

from asyncrl.orchestration.progress import Progress
from tests.helpers import launch_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(step, **kw):
    return {"step": step, "rollout/reward_mean": 0.5, "rollout/lag_mean": 0.75, "train/tokens_per_s": 15500.0, **kw}


def test_plain_lines_every_n_steps_and_at_the_last():
    out = io.StringIO()
    p = Progress(total=25, every=10, stream=out, tty=False)
    for s in range(1, 26):
        p.update(_row(s, **({"eval/reward_mean": 0.812} if s == 12 else {})))
    p.close()
    lines = out.getvalue().splitlines()
    assert [re.match(r"\[asyncrl\] step (\d+)/25", x).group(1) for x in lines] == ["10", "20", "25"]
    assert "eval" not in lines[0] and "eval 0.812" in lines[1] and "eval 0.812" in lines[2]  # the last eval sticks
    assert all("reward 0.500" in x and "lag 0.75" in x and "tok/s 15.5k" in x and "elapsed" in x for x in lines)
    assert "ETA" in lines[0] and "\r" not in out.getvalue()


def test_resumed_run_counts_from_the_checkpoint():
    out = io.StringIO()
    p = Progress(total=20, initial=10, every=5, stream=out, tty=False)
    for s in range(11, 21):
        p.update(_row(s))
    assert [x.split()[2] for x in out.getvalue().splitlines()] == ["15/20", "20/20"]


def test_bar_on_a_terminal_redraws_one_line():
    out = io.StringIO()
    p = Progress(total=4, every=1, stream=out, tty=True)
    for s in range(1, 5):
        p.update(_row(s, **({"eval/reward_mean": 0.9} if s == 2 else {})))
    p.close()
    text = out.getvalue()
    assert "[asyncrl] step" not in text  # no plain lines
    assert text.count("\n") <= 1 and "\r" in text  # one line, redrawn in place
    final = text.split("\r")[-1]
    assert "4/4" in final and "reward 0.500" in final and "eval 0.900" in final and "tok/s 15.5k" in final


TINY = ["train.format_warmstart_steps=0", "inference.max_seq_len=24", "inference.max_decode_batch_size=8",
        "inference.max_prefill_prompts=4", "train.train_batch_size=32", "inference.group_size=4",
        "eval.num_prompts=8", "eval.group_size=2", "eval.every_n_steps=4", "checkpoint.every_n_steps=0",
        "checkpoint.resume=false", "logging.ray_metrics=false", "logging.tensorboard=false"]
STEPS = 8


def _launch(run_dir, *overrides, tty):
    env = launch_env()
    env["RAY_DEDUP_LOGS"] = "0"  # Ray folds look-alike lines into "[repeated Nx]"; every line is counted here
    cmd = [sys.executable, "launch.py", f"run.run_dir={run_dir}", f"train.total_steps={STEPS}", *TINY, *overrides]
    if tty:  # a real pseudo-terminal for stdout and stderr: `script` runs the command under one
        cmd = ["script", "-q", "-e", "-c", " ".join(cmd), "/dev/null"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout + res.stderr


@pytest.mark.slow
def test_console_of_real_runs(tmp_path):
    # On a pipe at INFO: one plain line every 3 steps and at the last, no per-sync lines, the summary.
    text = _launch(tmp_path / "info", "logging.progress_every_n_steps=3", tty=False)
    assert re.findall(r"\[asyncrl\] step (\d+)/8", text) == ["3", "6", "8"], text[-3000:]
    assert "weights v" not in text
    assert "asyncrl run summary" in text and "eval reward after RL" in text
    info_lines = len(text.splitlines())
    # In a terminal at DEBUG: the bar instead of plain lines, and every weight sync's line is back.
    text = _launch(tmp_path / "debug", "logging.level=DEBUG", tty=True)
    assert not re.findall(r"\[asyncrl\] step \d+/8", text)
    assert re.search(r"asyncrl 8/8 \|", text), text[-3000:]  # the bar's final state
    synced = set(map(int, re.findall(r"weights v(\d+) received", text)))
    assert synced == set(range(STEPS + 1)), synced  # the initial weights and one sync per step
    assert len(text.splitlines()) > info_lines + STEPS


@pytest.mark.parametrize("level", ["INFO", "WARNING", "DEBUG"])
def test_warnings_and_errors_print_at_every_level_and_debug_brings_everything_back(level):
    import logging

    from asyncrl.orchestration import logs

    root = logging.getLogger()
    saved = root.level, {n: logging.getLogger(n).level for n in logs.CHATTY}
    try:
        logs.configure(level, "%(message)s")
        ours, chatty = logging.getLogger("asyncrl.orchestration.inference_worker"), logging.getLogger("orbax")
        for lg in (ours, chatty):
            assert lg.isEnabledFor(logging.WARNING) and lg.isEnabledFor(logging.ERROR)
        assert ours.isEnabledFor(logging.DEBUG) == (level == "DEBUG")  # per-sync lines
        assert ours.isEnabledFor(logging.INFO) == (level in ("INFO", "DEBUG"))
        assert chatty.isEnabledFor(logging.INFO) == (level == "DEBUG")  # chatter only when asked for everything
    finally:
        root.setLevel(saved[0])
        for n, lv in saved[1].items():
            logging.getLogger(n).setLevel(lv)


TRANSFORMERS_ADVICE = r"""
from transformers.utils import logging
logging.get_logger("transformers").warning_advice("PyTorch was not found. Models won't be available ...")
logging.get_logger("transformers").warning("a real warning")
"""


@pytest.mark.parametrize("host", [True, False])
def test_hosts_do_not_print_transformers_advice_about_pytorch(host):
    """On a machine without torch, importing transformers advises, once per host, that PyTorch is missing: nothing
    a user can act on (hosts only use its tokenizers). The host environment silences advice, not warnings."""
    from asyncrl.orchestration.driver import host_env

    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    if host:
        env |= host_env()
    res = subprocess.run([sys.executable, "-c", TRANSFORMERS_ADVICE], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    assert ("PyTorch was not found" in res.stderr) == (not host), res.stderr
    assert "a real warning" in res.stderr

