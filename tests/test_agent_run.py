"""An agent is an environment in a real run (`environment: agent`, `agent.fn` by import path): a 3-host `launch.py`
run at max_lag 2 whose episodes are played by an agent written against the `openai` client, in a package of its own
outside the repo. Every other agent rewrites its history before its last call (a new branch of its session), and
the run keeps branches (`agent.branches: keep`): both branches are trained, each its own trajectory, in groups of
varying size padded to the step's fixed rows. One run checks the acceptance of token exactness through the endpoint:
- every trained completion's ids are the concatenation of what the server sampled (each call's `token_ids`, as the
  agent got them) and the observation and template ids the server inserted (the next call's prompt ids hold them);
- the trainer's teacher-forced logprobs (its `get_logprobs`, with the saved weights of each token's version) equal
  the sampler's at every sampled token, fp32, within 1e-4;
- re-rendering the agent's history (the chat template writes the sampled `{"name":"add",...}` back spaced) would
  change the ids: the trajectory keeps the sampled ones.
- the Ray dashboard's Prometheus endpoint shows the endpoint's request rate and latency while the run goes (the
  `endpoint_requests` counter by server and status, the `endpoint_latency_s` histogram: `endpoint/metrics.py`).
The model is the endpoint tests' bigram table (`endpoint_fixtures.tool_call_model`), sampling its tool call at
temperature 1 (p ~0.9995 a token), with a little context mixing, saved as a Hugging Face folder."""

import dataclasses
import http.client
import json
import os
import re
import socket
import textwrap
import threading
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.endpoint.chat import ChatFormat
from asyncrl.models.checkpoint import save_pretrained
from tests.endpoint_fixtures import CALL, TOOLS, qwen3_tokenizer, tool_call_model
from tests.helpers import launch, rows

AGENT = '''
import itertools
import json
import os

TOOLS = {tools}
LOG = {log!r}
SESSIONS = itertools.count()  # every other session edits its history before its third call


def run(base_url, api_key, sample):
    """Three calls; each tool call answered; the whole history passed back; a reward the agent decides."""
    client = sample.client(max_retries=0, timeout=120)
    messages = [{{"role": "user", "content": sample.sample.prompt}}]
    calls = []
    edited = next(SESSIONS) % 2 == 1
    for i in range(3):
        if edited and i == 2:  # the first message rewritten: the server starts a new branch of the session
            messages = [{{"role": "user", "content": sample.sample.prompt + " Again."}}]
        r = client.chat.completions.create(model="asyncrl", messages=messages, tools=TOOLS, logprobs=True)
        msg = r.choices[0].message
        calls.append({{"prompt_ids": r.model_extra["prompt_token_ids"], "ids": r.choices[0].model_extra["token_ids"],
                      "logprobs": r.choices[0].model_extra["token_logprobs"], "branch": r.model_extra["branch"]}})
        messages.append(msg.model_dump(exclude_none=True))
        for c in msg.tool_calls or []:
            messages.append({{"role": "tool", "tool_call_id": c.id, "content": str(i + 2)}})
        if not msg.tool_calls:
            messages.append({{"role": "user", "content": "Use the tool."}})
    with open(os.path.join(LOG, sample.session_id + ".json"), "w") as f:
        json.dump({{"calls": calls, "messages": messages, "edited": edited, "sample": sample.sample.id}}, f)
    return int(sample.session_id[-2:], 16) / 255  # any reward the agent decides (varied: no group is dropped)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(url: str, stop: threading.Event, out: list[str]) -> None:
    """Keeps in `out` the latest Prometheus text at `url` that has the endpoint's metrics."""
    while not stop.wait(2.0):
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read().decode("utf-8", "replace")
        except (OSError, http.client.HTTPException):  # e.g. a read cut short while Ray's agent restarts
            continue
        if "endpoint_latency_s" in text:
            out[:] = [text]


def _series(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(tags, value) of every sample of metric `name` (Ray prefixes `ray_`; a counter may end in `_total`)."""
    out = []
    for tags, value in re.findall(rf"^(?:ray_)?{name}\{{([^}}]*)\}}\s+(\S+)$", text, re.M):
        out.append((dict(re.findall(r'(\w+)="([^"]*)"', tags)), float(value)))
    return out


def _checkpoint(run_dir: str, where: str, step: int):
    import orbax.checkpoint as ocp

    from asyncrl.models.params import LayerParams, Params

    mgr = ocp.CheckpointManager(os.path.join(run_dir, where), item_names=("state", "meta"))
    out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    mgr.close()
    p = out["state"]["params"]
    return Params(**{**p, "layers": LayerParams(**p["layers"])}), int(out["meta"].get("version", 0))


def agent_model(tok):
    """The tool call `CALL` after the assistant header's newline. The final RMSNorm scales the unit embeddings by
    sqrt(64) = 8, so a head column `3 * embed[a]` gives its token a logit of ~24 after `a`: sampled at temperature 1
    with p ~0.9995. Attention and MLP write a little (wo, w_down at a tenth of their init): the logprobs depend on the
    context, so the teacher-forced check tests the cache, the positions and the observations."""
    model, params = tool_call_model(tok, scale=3.0)
    init = model.init_params(jax.random.PRNGKey(1)).layers
    layers = dataclasses.replace(params.layers, wo=init.wo * 0.1, w_down=init.w_down * 0.1)
    return model, dataclasses.replace(params, layers=layers)


@pytest.mark.slow
def test_an_agent_trains_token_exact_through_the_endpoint(tmp_path):
    tok = qwen3_tokenizer(str(tmp_path / "qwen3"))
    model, params = agent_model(tok)
    folder = str(tmp_path / "model")
    save_pretrained(model, params, folder, copy_files_from=str(tmp_path / "qwen3"))
    log = tmp_path / "calls"
    log.mkdir()
    pkg = tmp_path / "user" / "my_agent"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "agent.py").write_text(textwrap.dedent(AGENT).format(tools=json.dumps(TOOLS), log=str(log)))
    run_dir = str(tmp_path / "run")
    steps = 3
    metrics_port, scraped, stop = _free_port(), [], threading.Event()
    scraper = threading.Thread(target=_scrape, args=(f"http://127.0.0.1:{metrics_port}/metrics", stop, scraped),
                               daemon=True)
    scraper.start()
    res = launch(run_dir, f"model.path={folder}", "run.hosts=3", "async.train_workers=1",
                 "async.max_lag=2", f"train.total_steps={steps}", "train.format_warmstart_steps=0",
                 "train.train_batch_size=8", "train.lr=1e-4", "train.warmup_steps=1", "inference.group_size=4",
                 "inference.temperature=1.0",
                 "inference.max_seq_len=256", "inference.max_new_tokens=16", "inference.max_turns=4",
                 "inference.max_decode_batch_size=8", "inference.max_prefill_prompts=2",
                 "inference.params_dtype=float32", "inference.kv_cache_dtype=float32", "eval.every_n_steps=0",
                 "task.sources=[{environment: agent, options: {task: digits}}]", "agent.fn=my_agent.agent:run",
                 "agent.workers=8", "agent.timeout_s=300", "agent.branches=keep", "agent.branch_rows=4",
                 "checkpoint.every_n_steps=1", "checkpoint.keep=3",
                 "checkpoint.resume=false", "loss.kl_coef=0.001", "logging.rollouts_every_n_steps=1",
                 "logging.rollout_tokens=true", "logging.progress=false", "run.dashboard=true",
                 f"run.dashboard_port={_free_port()}", f"run.metrics_export_port={metrics_port}", timeout=900,
                 env_extra={"PYTHONPATH": str(pkg.parent), "RAY_metrics_report_interval_ms": "1000"})
    stop.set()
    scraper.join()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    metrics = rows(run_dir)
    assert [x["step"] for x in metrics] == list(range(1, steps + 1))

    sessions = [json.loads(p.read_text()) for p in log.iterdir()]
    branches = {}  # the trajectory of each branch of each session (its last call's prompt and sample) -> its calls
    for s in sessions:
        for b in sorted({k["branch"] for k in s["calls"]}):
            calls = [k for k in s["calls"] if k["branch"] == b]
            branches[tuple(calls[-1]["prompt_ids"] + calls[-1]["ids"])] = (s, b, calls)
    with open(os.path.join(run_dir, "rollouts.jsonl")) as f:
        groups = [r for r in map(json.loads, f) if "completions" in r]
    items = [(r, c) for r in groups for c in r["completions"]]
    # One prompt a step (8 rows = group_size 4 + branch_rows 4); a group holds its 4 episodes' last branches and
    # the earlier branches of those that edited, every one of them trained.
    assert len(groups) == steps and all(4 <= len(r["completions"]) <= 8 for r in groups), [len(r["completions"])
                                                                                             for r in groups]
    # The earlier branches trained are those of the group's sessions that edited (the run sampled more groups than
    # it trained: sessions are matched to a trained group by their sample).
    for r in groups:
        mine = [s for s in sessions if s["sample"] == r["id"]]
        assert len(mine) == 4, (r["id"], len(mine))
        n_branches = [len({k["branch"] for k in s["calls"]}) for s in mine]
        assert all(n > 1 for s, n in zip(mine, n_branches) if s["edited"])
        assert sum(c.get("end") == "branched" for c in r["completions"]) == sum(n - 1 for n in n_branches)
    assert sum(c.get("end") == "branched" for _, c in items) >= 1
    assert all(c.get("end", "done") in ("done", "branched") for _, c in items)
    lags = [r["trainer_version"] - min(c["tokens"]["versions"]) for r, c in items]
    assert max(lags) <= 2
    assert any(m.get("rollout/branches_kept", 0) > 0 for m in metrics)

    # 4. The dashboard: the endpoint's requests counted by server and status, their latencies in the histogram.
    assert scraped, f"the endpoint's metrics never showed up at 127.0.0.1:{metrics_port}"
    answered = [(t, v) for t, v in _series(scraped[0], "endpoint_requests(?:_total)?") if t.get("status") == "200"]
    assert answered and all(t["server"].startswith("inference") for t, _ in answered), answered
    assert sum(v for _, v in answered) >= 3, answered  # an agent's three calls at least
    timed = _series(scraped[0], "endpoint_latency_s_count")
    assert timed and sum(v for _, v in timed) >= 3, timed
    buckets = [(float(t["le"]), v) for t, v in _series(scraped[0], "endpoint_latency_s_bucket")]
    assert buckets and max(v for _, v in buckets) >= 3, buckets

    # 1. The trajectory is what the server sampled, with the observation ids it inserted between the calls. A call
    # after a plain answer adds a user message, after which Qwen3's template renders the answer differently: the
    # server starts a new branch there, and (agent.branches=drop) the last branch is the one trained.
    call_ids = tok.encode(CALL)
    with_calls = n_calls = 0
    for r, c in items:
        t = c["tokens"]
        s, branch, calls = branches[tuple(r["prompt_ids"] + t["ids"])]  # one branch of an agent's session, exactly
        assert len(s["calls"]) == 3 and (c.get("end") == "branched") == (branch != s["calls"][-1]["branch"])
        for a, b in zip(calls, calls[1:]):  # each call's prompt is the last one's, its sample, and what was inserted
            assert b["prompt_ids"][:len(a["prompt_ids"]) + len(a["ids"])] == a["prompt_ids"] + a["ids"]
        obs = np.asarray(t["observation"], bool)
        sampled = np.asarray(t["ids"])[~obs]
        assert sampled.tolist() == sum((k["ids"] for k in calls), [])
        assert np.array_equal(np.asarray(t["logprobs"], np.float32)[~obs],
                              np.asarray(sum((k["logprobs"] for k in calls), []), np.float32))
        with_calls, n_calls = with_calls + sum(k["ids"] == call_ids for k in calls), n_calls + len(calls)
    assert with_calls >= 0.9 * n_calls  # nearly every turn is the tool call, parsed into tool_calls

    # 3. Re-rendering the history would change the ids (the template spaces the call's JSON); the trajectory keeps
    # the sampled call, compact, as the server sampled it.
    fmt = ChatFormat(tok)
    drift = called = 0
    for r, c in items:
        s, _, _ = branches[tuple(r["prompt_ids"] + c["tokens"]["ids"])]
        if s["edited"]:
            continue  # its last call's history is a fresh render of the rewritten message
        last = max(i for i, m in enumerate(s["messages"]) if m["role"] == "assistant")
        if not all(m.get("tool_calls") for m in s["messages"][:last] if m["role"] == "assistant") or last < 2:
            continue  # one branch of tool calls to the last call: its history is the trajectory's prompt
        called += 1
        rerendered = fmt.prompt_ids(s["messages"][:last], TOOLS)  # the last call's history, rendered afresh
        drift += rerendered != s["calls"][-1]["prompt_ids"]
    assert called > 0 and drift == called, (called, drift)
    assert '{"name":"add","arguments":{"x":1}}' in tok.decode(items[0][0]["prompt_ids"] + items[0][1]["tokens"]["ids"],
                                                              skip_special_tokens=False)

    # 2. The trainer's teacher-forced logprobs equal the sampler's at every sampled token, each token scored with
    # the weights of its version (a token is checkable while everything before it was computed by one version).
    weights = {v: p for p, v in [_checkpoint(run_dir, "reference", 0)]
               + [_checkpoint(run_dir, "checkpoints", k) for k in range(1, steps + 1)]}
    width = 256  # inference.max_seq_len: one shape, one compile for every version's batch
    score = jax.jit(model.get_logprobs, static_argnums=3)
    worst, checked = 0.0, 0
    for version in sorted({c["prompt_version"] for _, c in items}):
        group = [(r, c) for r, c in items if c["prompt_version"] == version]
        seqs = np.zeros((len(group), width), np.int32)
        lens = np.asarray([len(r["prompt_ids"]) + len(c["tokens"]["ids"]) for r, c in group], np.int32)
        for i, (r, c) in enumerate(group):
            seqs[i, :lens[i]] = r["prompt_ids"] + c["tokens"]["ids"]
        lp_all = np.asarray(score(weights[version], jnp.asarray(seqs), jnp.asarray(lens), 1.0))
        for (r, c), lp in zip(group, lp_all, strict=True):
            t = c["tokens"]
            same = np.cumprod(np.asarray(t["versions"]) == version).astype(bool)  # computed by one version so far
            keep = same & ~np.asarray(t["forced"], bool)
            n = len(r["prompt_ids"])
            diff = np.abs(lp[n - 1:n - 1 + len(t["ids"])][keep] - np.asarray(t["logprobs"], np.float32)[keep])
            worst, checked = max(worst, float(diff.max(initial=0.0))), checked + int(keep.sum())
    print(f"agent run: {len(items)} completions, {checked} sampled tokens rescored, max |diff| {worst:.2e}, "
          f"lags {sorted(set(lags))}, {with_calls} tool-call turns")
    assert checked >= 20 * len(items) and worst <= 1e-4, (checked, worst)
