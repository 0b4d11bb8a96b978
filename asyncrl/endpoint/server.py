"""The HTTP server: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, on aiohttp (which Ray
brings), in its own thread and event loop beside the engine's decode thread (`loop.EngineLoop`).

A handler parses and checks the request (`protocol.py`), renders the prompt ids (`chat.py`), submits them to the
engine loop (at most `endpoint.max_queued` at once: one more is answered 429), awaits the finished group without
blocking the event loop, and answers whole or as server-sent events (`responses.py`). The tokens it answers with are
the engine's samples: nothing is decoded by a second loop."""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from asyncrl.endpoint.chat import ChatFormat, Reply
from asyncrl.endpoint.config import EndpointConfig
from asyncrl.endpoint.loop import EngineLoop, Overloaded
from asyncrl.endpoint.metrics import ServerMetrics
from asyncrl.endpoint.protocol import ApiError, ChatRequest, Limits, parse_chat, parse_completion
from asyncrl.endpoint.responses import Bodies, TurnOut, sse
from asyncrl.endpoint.sessions import SessionStore
from asyncrl.inference.engine import Engine, Request
from asyncrl.rollout import Prompt, Rollout

log = logging.getLogger(__name__)

_POSITION_BASE = 2_000_000_000  # request seeds start here: clear of the data stream's and the evals' positions


def engine_limits(engine: Engine, chat: ChatFormat | None) -> Limits:
    tok = engine.tokenizer
    stop = tuple(tok.decode(list(s), skip_special_tokens=False) for s in engine.stop) if tok is not None else ()
    return Limits(engine.cfg.temperature, engine.cfg.max_seq_len, engine.cfg.max_new_tokens, stop)


class EndpointServer:
    """Serves `loop`'s engine. `chat`: the chat rendering (None: `/v1/chat/completions` is refused, the tokenizer
    has no template). `start()` returns the base URL (`http://host:port/v1`)."""

    def __init__(self, cfg: EndpointConfig, loop: EngineLoop, chat: ChatFormat | None):
        self.cfg, self.loop, self.chat = cfg, loop, chat
        self.engine = loop.engine
        self.tokenizer = self.engine.tokenizer
        self.limits = engine_limits(self.engine, chat)
        # Calls that name a session go to its episode (`sessions.py`); without a store they are served alone.
        self.sessions = SessionStore(cfg.session_idle_s)
        self.url = ""
        self._seeds = itertools.count()
        self._aio: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.metrics = ServerMetrics(self.engine.name)

    # ---- lifecycle ------------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        return app

    def start(self, timeout: float = 30.0) -> str:
        ready = threading.Event()
        failed: list[BaseException] = []

        def serve() -> None:
            self._aio = aio = asyncio.new_event_loop()
            asyncio.set_event_loop(aio)
            try:
                self._runner = web.AppRunner(self.app(), access_log=None)
                aio.run_until_complete(self._runner.setup())
                site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
                aio.run_until_complete(site.start())
                port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
                host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
                self.url = f"http://{host}:{port}/v1"
            except BaseException as e:  # noqa: BLE001 - handed to start(), which raises it
                failed.append(e)
                ready.set()
                return
            ready.set()
            aio.run_forever()
            aio.run_until_complete(self._runner.cleanup())
            aio.close()

        self._thread = threading.Thread(target=serve, name="endpoint-http", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError(f"the endpoint server did not bind {self.cfg.host}:{self.cfg.port} in {timeout} s")
        if failed:
            raise failed[0]
        return self.url

    def later(self, seconds: float, fn: Callable[[], None]) -> None:
        """`fn()` on the server's event loop after `seconds` (a session's idle timeout: a timer, not a thread)."""
        aio = self._aio
        try:
            aio.call_soon_threadsafe(aio.call_later, seconds, fn)  # type: ignore[union-attr]
        except (AttributeError, RuntimeError):  # not started, or stopped: no call can answer it, so it fires now
            log.info("endpoint server not running: a %gs timer fires at once", seconds)
            fn()

    def stop(self) -> None:
        if self._aio is not None:
            self._aio.call_soon_threadsafe(self._aio.stop)
        if self._thread is not None:
            self._thread.join(30)

    # ---- middleware -----------------------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        t0 = time.perf_counter()
        status = 500
        try:
            given = request.headers.get("Authorization", "").encode()
            if self.cfg.api_key and not hmac.compare_digest(given, f"Bearer {self.cfg.api_key}".encode()):
                raise ApiError(401, "a valid bearer token is required (Authorization: Bearer <endpoint.api_key>)",
                               None, "authentication_error")
            resp = await handler(request)
            status = resp.status
            return resp
        except ApiError as e:
            status = e.status
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method
            status = e.status
            return web.json_response(ApiError(e.status, e.reason).body(), status=e.status)
        except Exception as e:  # noqa: BLE001 - a bug answers one request with its reason; the server goes on
            log.exception("the endpoint failed on %s", request.path)
            return web.json_response(ApiError(500, f"internal error: {e!r}", None, "server_error").body(), status=500)
        finally:
            self.metrics.observe(status, time.perf_counter() - t0)

    @staticmethod
    async def _json(request: web.Request) -> Any:
        try:
            return json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", "body") from e

    # ---- routes ---------------------------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.cfg.model, "object": "model", "created": 0, "owned_by": "asyncrl",
             "max_model_len": self.limits.max_seq_len, "weight_version": self.engine.version}]})

    def check_context(self, ids: list[int], param: str) -> None:
        S = self.limits.max_seq_len
        if len(ids) + 1 >= S:  # the prompt and at least one sampled token must fit
            raise ApiError(400, f"{param}: the prompt is {len(ids)} tokens; the context (inference.max_seq_len="
                                f"{S}) leaves no room for a reply", param, "context_length_exceeded")

    def next_position(self) -> int:
        return _POSITION_BASE + next(self._seeds)

    async def run(self, prompt_ids: list[int], n: int, seed: int | None) -> Rollout:
        """Sample `n` completions of `prompt_ids` on the engine's decode thread; raises ApiError 429 / 504 / 500."""
        position = seed if seed is not None else self.next_position()
        req = Request(Prompt(position, None, n), prompt_ids)
        try:
            fut = self.loop.submit(req)
        except Overloaded as e:
            raise ApiError(429, f"the engine is at capacity: {e}; retry later", None, "rate_limit_exceeded") from e
        except RuntimeError as e:
            raise ApiError(500, str(e), None, "server_error") from e
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.cfg.request_timeout_s)
        except TimeoutError as e:
            raise ApiError(504, f"no completion within endpoint.request_timeout_s={self.cfg.request_timeout_s}",
                           None, "timeout") from e
        except RuntimeError as e:
            raise ApiError(500, str(e), None, "server_error") from e

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        if self.chat is None:
            raise ApiError(400, "messages: this tokenizer has no chat template; use /v1/completions", "messages")
        req = parse_chat(body, self.cfg, self.limits)
        req.session = req.session or request.headers.get("X-Session-Id")  # a header: no body field to add
        if req.session is not None:
            return await self.sessions.chat(self, request, req)
        ids = self.chat.prompt_ids(req.messages, req.tools)
        self.check_context(ids, "messages")
        rollout = await self.run(ids, req.sampling.n, req.sampling.seed)
        turns = [TurnOut.last_turn(c) for c in rollout.completions]
        return await self.answer_chat(request, req, ids, turns)

    async def answer_chat(self, request: web.Request, req: ChatRequest, prompt_ids: list[int],
                          turns: list[TurnOut], extra: dict[str, Any] | None = None,
                          replies: list[Reply] | None = None) -> web.StreamResponse:
        tools = req.tools if req.tool_choice != "none" else []
        if replies is None:
            replies = [self.chat.reply(t.tokens, tools, t.hit_length) for t in turns]  # type: ignore[union-attr]
        choices = list(zip(replies, turns))
        bodies = Bodies(self.cfg.model, self.tokenizer, "chat")
        s = req.sampling
        if not s.stream:
            return web.json_response(bodies.chat(prompt_ids, choices, s.logprobs, extra))
        return await self._stream(request, bodies.chat_chunks(prompt_ids, choices, s.logprobs, s.include_usage,
                                                              extra))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_completion(await self._json(request), self.cfg, self.limits)
        tok = self.tokenizer
        ids = list(req.prompt) if isinstance(req.prompt, list) else tok.encode_prompt(req.prompt)
        if any(t >= tok.vocab_size for t in ids):
            raise ApiError(400, f"prompt: token ids must be below the vocabulary size {tok.vocab_size}", "prompt")
        self.check_context(ids, "prompt")
        rollout = await self.run(ids, req.sampling.n, req.sampling.seed)
        turns = [TurnOut.last_turn(c) for c in rollout.completions]
        texts = [tok.decode(t.tokens[:-1] if len(t.tokens) and t.tokens[-1] == self.engine.eos_id else t.tokens)
                 for t in turns]
        bodies = Bodies(self.cfg.model, tok, "completion")
        body = bodies.completion(ids, turns, texts, req.sampling.logprobs)
        if not req.sampling.stream:
            return web.json_response(body)
        return await self._stream(request, bodies.completion_chunks(body, req.sampling.include_usage))

    @staticmethod
    async def _stream(request: web.Request, chunks: Any) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for c in chunks:
            await resp.write(sse(c))
        await resp.write(sse("[DONE]"))
        await resp.write_eof()
        return resp
