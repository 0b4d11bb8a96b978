"""Agents through the OpenAI endpoint against the same episodes as a built-in environment, on one engine.

SESSIONS concurrent agent sessions, each making CALLS calls with AGENT_S of agent work between them (the `openai`
client over HTTP, loopback, `asyncrl/endpoint/`), against the same number of episodes played by a built-in
environment whose step sleeps AGENT_S and answers with the same observation ids (no HTTP, no rendering). Both go
through the same engine and its one decode loop (`EngineLoop`), so the ratio of decode tokens/s is what the HTTP
path, the rendering and the session bookkeeping cost. Also the per-call overhead of the HTTP path: the latency of
sequential session-less calls against the same requests submitted to the engine loop directly (same prompt, same
seed, so the same tokens), in ms. Rounds alternate (ABBA): this machine's speed drifts.

    python benchmarks/endpoint_throughput.py [--sessions 32] [--calls 3] [--agent-s 0.5] [--rounds 2]

Writes benchmarks/results/endpoint_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from asyncrl.endpoint.agents import AgentSample  # noqa: E402
from asyncrl.endpoint.chat import ChatFormat  # noqa: E402
from asyncrl.endpoint.config import EndpointConfig  # noqa: E402
from asyncrl.endpoint.loop import EngineLoop  # noqa: E402
from asyncrl.endpoint.server import EndpointServer  # noqa: E402
from asyncrl.inference.config import InferenceConfig  # noqa: E402
from asyncrl.inference.engine import Engine, Request  # noqa: E402
from asyncrl.models import Model, preset  # noqa: E402
from asyncrl.models.tokenizer import Tokenizer, build_char_tokenizer  # noqa: E402
from asyncrl.rollout import Prompt, StepResult  # noqa: E402
from benchmarks.machine import machine as host_machine  # noqa: E402

FOLLOW_UP = {"role": "user", "content": "ok"}


class SleepyEnv:
    """The built-in twin of an agent: its step sleeps the agent's work, then answers with the same ids."""

    stop: tuple = ()

    def __init__(self, prompt: list[int], obs: list[int], delay_s: float):
        self.prompt, self.obs, self.delay_s = prompt, obs, delay_s

    def reset(self) -> list[int]:
        return list(self.prompt)

    def step(self, turn) -> StepResult:
        time.sleep(self.delay_s)
        if turn.last:
            return StepResult(None, 0.0, True, "done")
        return StepResult(self.obs, 0.0, False)


def agents(server: EndpointServer, n: int, calls: int, agent_s: float, tag: str) -> None:
    def one(i: int) -> None:
        view = AgentSample(None, f"{tag}-{i}", server.url, "none")
        client = view.client(max_retries=0, timeout=600)
        messages = [{"role": "user", "content": f"episode {i}"}]
        for k in range(calls):
            r = client.chat.completions.create(model="asyncrl", messages=messages)
            messages += [r.choices[0].message.model_dump(exclude_none=True), FOLLOW_UP]
            if k + 1 < calls:
                time.sleep(agent_s)
        server.sessions.end(view.session_id, 0.0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def builtin(server: EndpointServer, n: int, agent_s: float, obs: list[int], base: int) -> None:
    futs = []
    for i in range(n):
        ids = server.chat.prompt_ids([{"role": "user", "content": f"episode {i}"}], [])
        futs.append(server.loop.submit(Request(Prompt(base + i, None, 1), ids, [SleepyEnv(ids, obs, agent_s)])))
    for f in futs:
        f.result(600)


def timed(engine: Engine, fn) -> dict[str, float]:
    g0, t0 = engine.stats.generated_tokens, time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    tokens = engine.stats.generated_tokens - g0
    return {"wall_s": wall, "tokens": float(tokens), "tokens_per_s": tokens / wall}


def overhead_ms(server: EndpointServer, client, calls: int) -> dict[str, float]:
    """Sequential calls: HTTP (parse, render, answer) vs the engine loop directly, same prompts and seeds."""
    msgs = [{"role": "user", "content": "overhead"}]
    ids = server.chat.prompt_ids(msgs, [])
    http, direct = [], []
    for k in range(calls):
        t0 = time.perf_counter()
        client.chat.completions.create(model="asyncrl", messages=msgs, seed=900_000 + k)
        http.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        server.loop.submit(Request(Prompt(900_000 + k, None, 1), ids)).result(600)
        direct.append(time.perf_counter() - t0)
    return {"http_ms": 1e3 * float(np.median(http)), "direct_ms": 1e3 * float(np.median(direct)),
            "overhead_ms": 1e3 * float(np.median(np.subtract(http, direct)))}


def main() -> int:
    import openai

    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--agent-s", type=float, default=0.5)
    ap.add_argument("--tokens-per-turn", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="endpoint and built-in runs, alternating (ABBA)")
    ap.add_argument("--overhead-calls", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "endpoint_throughput.json"))
    args = ap.parse_args()

    # The tiny model's character tokenizer, its turns ending where its chat template ends them (<|im_end|>).
    tok = Tokenizer.from_folder(build_char_tokenizer(os.path.join(tempfile.mkdtemp(), "char")), eos_token="<|im_end|>")
    model = Model(preset("tiny"))
    params = model.init_params(jax.random.PRNGKey(0))
    span = 16 + args.calls * (args.tokens_per_turn + 24)
    cfg = InferenceConfig(group_size=1, max_decode_batch_size=args.sessions, max_prefill_prompts=8,
                          max_seq_len=64 * ((span + 63) // 64), temperature=1.0, params_dtype="float32",
                          kv_cache_dtype="float32", min_prefill_bucket=16, max_turns=args.calls,
                          max_new_tokens=args.tokens_per_turn)
    engine = Engine(model, params, cfg, tok, seed=0)
    loop = EngineLoop(engine, max_queued=4 * args.sessions, max_sessions=4 * args.sessions)
    loop.start()
    server = EndpointServer(EndpointConfig(max_queued=4 * args.sessions, max_sessions=4 * args.sessions), loop,
                            ChatFormat(tok))
    server.start()
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=600)
    # The observation the built-in twin inserts: what the server inserts after a turn for the agent's follow-up.
    obs = server.sessions._renderer(server, [], "[]").after([tok.eos_id], [FOLLOW_UP])
    # Warm-up: every program the measured runs use, compiled.
    agents(server, args.sessions, args.calls, 0.0, "warm")
    builtin(server, args.sessions, 0.0, obs, 500_000)
    rounds = []
    for i in range(args.rounds):
        order = ("endpoint", "builtin") if i % 2 == 0 else ("builtin", "endpoint")
        r = {}
        for name in order:
            r[name] = timed(engine, lambda: agents(server, args.sessions, args.calls, args.agent_s, f"r{i}")) \
                if name == "endpoint" else \
                timed(engine, lambda: builtin(server, args.sessions, args.agent_s, obs, 600_000 + 1000 * i))
        r["ratio"] = r["endpoint"]["tokens_per_s"] / r["builtin"]["tokens_per_s"]
        rounds.append(r)
    over = overhead_ms(server, client, args.overhead_calls)
    server.stop()
    loop.stop()
    ratio = float(np.median([r["ratio"] for r in rounds]))
    machine = host_machine()
    print(f"{'round':6}{'path':10}{'wall s':>8}{'tokens':>8}{'tok/s':>8}")
    for i, r in enumerate(rounds):
        for name in ("endpoint", "builtin"):
            x = r[name]
            print(f"{i:<6}{name:10}{x['wall_s']:8.2f}{x['tokens']:8.0f}{x['tokens_per_s']:8.0f}")
    print(f"endpoint / built-in decode tokens/s: {ratio:.3f} (median of {len(rounds)} rounds; aim: >= 0.8)")
    print(f"per call, sequential: HTTP {over['http_ms']:.1f} ms, engine loop direct {over['direct_ms']:.1f} ms, "
          f"HTTP overhead {over['overhead_ms']:.1f} ms ({machine})")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "machine": machine, "rounds": rounds, "ratio": ratio, "overhead": over}, f,
                  indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
