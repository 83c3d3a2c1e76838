"""SGLang's native HTTP endpoints over the embedded `Engine`, on FastAPI + uvicorn (as SGLang's own).

    srv = serve(engine, host="127.0.0.1", port=0, api_key="k")   # uvicorn in a background thread
    srv.url  ->  "http://127.0.0.1:54321";  srv.shutdown()

Endpoints (as sglang 0.5.x): POST /generate; GET /health, /health_generate; GET /model_info
(/get_model_info), /trace_policy (as the SGLang plugin's); GET|POST /flush_cache,
/release_memory_occupation and /resume_memory_occupation ({"tags"}: kv_cache, weights); POST /pause_generation,
/continue_generation, /update_weights_from_disk, /update_weights_from_tensor, /init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group, /update_weight_version;
our extension POST /get_guidance {"rid"} -> application/octet-stream record bytes (404 JSON for an unknown
or already-fetched rid), the same as the SGLang plugin's. A request asks for guidance with
`sampling_params.custom_params.trace_return_guidance` (what SGLang passes to its scheduler; the old
top-level `return_guidance` is accepted too).

Deliberate difference from SGLang — NO PICKLE: weights arrive as safetensors bytes, never pickled
CUDA-IPC handles (the weight endpoints live in `weight_routes.py`, which says what they accept).

Errors are SGLang's: 400 with {"error": {"message", "code"}} ({"error": "<text>"} on /generate),
401 {"error": "Unauthorized"} (every path but /health* needs `Authorization: Bearer <key>` when a
key is configured), 413 {"error": {"message", "code"}} over the body limit, weight updates answer
{"success", "message"} with 200 or 400 (`http_util`: the middleware and exception handlers).

Threads: the event loop only parses and answers. Every engine or weight-group call (a generation
waiting for its results, a pause, a weight load, a rendezvous) runs in one thread pool of the
server's own, sized like the thread-per-connection server this replaces: a wait parked while
generation is paused holds a pool thread, never the loop, and never starves /continue_generation
(which Starlette's default 40-thread pool could, with 40 parked waits).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from sglang_backend.api import GUIDANCE_KEY, TRACE_POLICY_PATH, GenerateRequest, SamplingParams, trace_policy_of
from sglang_backend.weight_group import WeightGroup

from .engine import Engine
from .http_util import (
    HalfCloseH11Protocol,
    HTTPError,
    ReadyUvicorn,
    RequestGuard,
    install_error_handlers,
    is_loopback,
    json_response,
    listen,
    read_body,
    read_json,
    want,
)
from .weight_routes import WeightUpdateRoutes

log = logging.getLogger(__name__)
OPEN_PATHS = {"/health", "/health_generate"}
_BLOCKING_THREADS = 1024  # requests that may wait on the engine at once (more queue for a thread)


class RolloutServer(WeightUpdateRoutes):
    """Routes + state (pause flag, weight groups); uvicorn serves them from one background thread.
    The weight-update routes come from `WeightUpdateRoutes` (weight_routes.py)."""

    def __init__(
        self,
        engine: Engine,
        host: str,
        port: int,
        api_key: str | None,
        max_body_bytes: int,
        request_timeout_s: float | None = None,
        dist_timeout_s: float = 300.0,
    ):
        if not is_loopback(host) and not api_key:
            raise ValueError(
                f"refusing to serve on non-loopback host {host!r} without an API key: "
                "pass --api-key (anyone who can reach the port could replace the weights)"
            )
        self.engine, self.api_key, self.max_body_bytes = engine, api_key, int(max_body_bytes)
        self.request_timeout_s, self.dist_timeout_s = request_timeout_s, dist_timeout_s
        self.paused = False
        self.closing = False
        self.groups: dict[str, WeightGroup] = {}
        self._lock = threading.Lock()
        self.routes: dict[str, tuple[set[str], Callable]] = {
            "/generate": ({"POST"}, self.generate),
            "/health": ({"GET", "POST"}, self.health),
            "/health_generate": ({"GET", "POST"}, self.health_generate),
            "/model_info": ({"GET"}, self.model_info),
            "/get_model_info": ({"GET"}, self.model_info),
            TRACE_POLICY_PATH: ({"GET"}, self.trace_policy),
            "/flush_cache": ({"GET", "POST"}, self.flush_cache),
            "/pause_generation": ({"POST"}, self.pause),
            "/continue_generation": ({"POST"}, self.resume),
            "/update_weights_from_disk": ({"POST"}, self.update_from_disk),
            "/update_weights_from_tensor": ({"POST"}, self.update_from_tensor),
            "/init_weights_update_group": ({"POST"}, self.init_group),
            "/update_weights_from_distributed": ({"POST"}, self.update_from_distributed),
            "/destroy_weights_update_group": ({"POST"}, self.destroy_group),
            "/update_weight_version": ({"POST"}, self.update_weight_version),
            "/get_guidance": ({"POST"}, self.get_guidance),
            "/release_memory_occupation": ({"GET", "POST"}, self.release_memory),
            "/resume_memory_occupation": ({"GET", "POST"}, self.resume_memory),
        }
        self.app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)  # the routes above, nothing else
        for path, (methods, endpoint) in self.routes.items():
            self.app.add_api_route(path, endpoint, methods=sorted(methods))
        self.app.add_middleware(
            RequestGuard, api_key=api_key, open_paths=OPEN_PATHS, max_body_bytes=self.max_body_bytes
        )
        install_error_handlers(self.app)
        self._pool = ThreadPoolExecutor(_BLOCKING_THREADS, thread_name_prefix="rollout-http-engine")
        self.socket = listen(host, port)
        self.host, self.port = host, self.socket.getsockname()[1]
        # log_config=None: leave the host process's logging alone (uvicorn's warnings reach its root).
        # timeout_keep_alive 30 s: longer than the client's pool keeps an idle connection (2 s), so
        # the client always drops one first and never races the server closing it.
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            http=HalfCloseH11Protocol,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=2,
        )
        self._uvicorn = ReadyUvicorn(config)
        self._thread = threading.Thread(
            target=self._uvicorn.run, kwargs={"sockets": [self.socket]}, name="rollout-http", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> RolloutServer:
        self._thread.start()
        while not self._uvicorn.ready.wait(0.1):  # not a poll for a result: it notices a thread that died
            if not self._thread.is_alive():
                self.socket.close()
                raise RuntimeError(f"the HTTP server on {self.url} failed to start (see the log above)")
        return self

    def shutdown(self) -> None:
        """Stop serving HTTP (503 on /health meanwhile); the engine's lifetime is the caller's.
        Requests still running after uvicorn's 2 s grace are cancelled; their engine waits end
        with the engine."""
        self.closing = True
        self._uvicorn.should_exit = True
        self._thread.join(30)
        if self._thread.is_alive():
            log.warning("the HTTP server on %s did not stop within 30 s; its thread is left running", self.url)
        self.socket.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for g in self.groups.values():
            g.close()

    async def _blocking(self, fn: Callable, *args: Any) -> Any:
        """`fn(*args)` in the server's thread pool (see the module docstring), off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # -- generation ------------------------------------------------------------------------------
    async def generate(self, request: Request) -> Response:
        return await self._blocking(self._generate, await read_json(request, required=True))

    def _generate(self, d: dict[str, Any]) -> Response:
        """Parse, queue, wait, and encode the answer, all in a pool thread: the event loop only moves bytes."""
        if d.get("text") is not None:
            raise HTTPError(400, "'text' is not supported: this server has no tokenizer; send input_ids", "text")
        ids = want(d, "input_ids", list, style="text")
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        for i, p in enumerate(prompts):
            if not isinstance(p, list) or not p or not all(type(t) is int for t in p):
                where = f"input_ids[{i}]" if batch else "input_ids"
                raise HTTPError(400, f"{where} must be a non-empty list of int token ids", "text")
        sp = d.get("sampling_params")
        sps = sp if isinstance(sp, list) else [sp] * len(prompts)
        rid = d.get("rid")
        rids = rid if isinstance(rid, list) else [rid] * len(prompts)
        if len(sps) != len(prompts) or len(rids) != len(prompts):
            raise HTTPError(400, f"sampling_params / rid lists must have one entry per prompt ({len(prompts)})", "text")
        ret_lp = bool(d.get("return_logprob", False))
        routed = d.get("return_routed_experts", False)  # SGLang's top-level key
        if not isinstance(routed, bool):
            raise HTTPError(400, f"return_routed_experts must be true or false; got {routed!r}", "text")
        vocab = self.engine.arch.vocab_size
        reqs = []
        for p, s, r in zip(prompts, sps, rids):
            if s is not None and not isinstance(s, dict):
                raise HTTPError(400, f"sampling_params must be an object; got {type(s).__name__}", "text")
            if r is not None and not isinstance(r, str):
                raise HTTPError(400, f"rid must be a string; got {type(r).__name__}", "text")
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:  # checked for all prompts before any is queued: a batch is all or nothing
                raise HTTPError(400, f"input_ids hold tokens outside the vocabulary [0, {vocab}): {bad[:5]}", "text")
            s = dict(s or {})
            custom = s.pop("custom_params", None) or {}  # SGLang's pass-through to its scheduler
            if not isinstance(custom, dict):
                raise HTTPError(
                    400, f"sampling_params.custom_params must be an object; got {type(custom).__name__}", "text"
                )
            try:
                params = SamplingParams.from_dict(s)
            except (ValueError, TypeError) as e:
                raise HTTPError(400, str(e), "text") from None
            guided = bool(custom.get(GUIDANCE_KEY, False)) or bool(d.get("return_guidance", False))
            reqs.append(GenerateRequest(p, params, r, ret_lp, guided, routed))
        submitted: list[str] = []
        try:
            for r in reqs:
                submitted += self.engine.submit(r)
        except (ValueError, RuntimeError) as e:
            if submitted:  # collect the already-queued ones so their results don't pile up
                threading.Thread(target=self.engine.wait, args=(submitted,), daemon=True).start()
            raise HTTPError(400, str(e), "text") from None
        # While paused the engine queues these; this pool thread waits for resume, as SGLang's does.
        try:
            out = [r.to_sglang(ret_lp) for r in self.engine.wait(submitted, timeout=self.request_timeout_s)]
        except TimeoutError as e:
            raise HTTPError(504, str(e), "text") from None
        return json_response(200, out if batch or len(out) > 1 else out[0])

    async def get_guidance(self, request: Request) -> Response:
        d = await read_json(request, required=True)
        handle = want(d, "rid" if "rid" in d or "handle" not in d else "handle", str)  # "handle": the old name
        try:
            data = await self._blocking(lambda: self.engine.fetch_guidance(handle).to_bytes())  # the wire form
        except KeyError as e:
            raise HTTPError(404, str(e.args[0])) from None
        return Response(data, media_type="application/octet-stream")

    # -- health & info ---------------------------------------------------------------------------
    def _alive(self) -> bool:
        alive = getattr(self.engine, "is_alive", None)  # a dead scheduler thread means no answers
        return not self.closing and (alive is None or alive())

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self._alive() else 503)

    async def health_generate(self, request: Request) -> Response:
        if not self._alive():
            return Response(status_code=503)
        if self.paused:  # alive, just held: a probe generation would wait for resume
            return Response(status_code=200)
        return Response(status_code=200 if await self._blocking(self._probe_generation) else 503)

    def _probe_generation(self) -> bool:
        try:
            rids = self.engine.submit(GenerateRequest([0], SamplingParams(max_new_tokens=1), return_logprob=False))
            res = self.engine.wait(rids, timeout=30)
            return res[0].finish_reason.get("type") != "abort"
        except Exception:
            return False

    async def model_info(self, request: Request) -> Response:
        info = await self._blocking(self.engine.get_model_info)
        info.update(paused=self.paused, weight_update_groups=sorted(self.groups), max_body_bytes=self.max_body_bytes)
        return json_response(200, info)

    async def trace_policy(self, request: Request) -> Response:
        info = await self._blocking(self.engine.get_model_info)
        return json_response(
            200,
            trace_policy_of(
                info["kv_formats"], info["quant_policy"]["kv_k_debias"], info["guided_layers"], info["guidance_mode"]
            ),
        )

    # -- control ---------------------------------------------------------------------------------
    async def flush_cache(self, request: Request) -> Response:
        await read_body(request)
        if await self._blocking(self.engine.flush_cache):
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: there are running or waiting requests.\n", 400)

    async def pause(self, request: Request) -> Response:
        mode = want(await read_json(request), "mode", str, "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise HTTPError(400, f"mode must be one of abort, retract, in_place; got {mode!r}")
        # All three hold the batch in place here: the embedded engine keeps in-flight requests
        # (their KV stays reserved) and finishes them after /continue_generation.
        await self._blocking(self.engine.pause_generation)
        self.paused = True
        return json_response(200, {"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: Request) -> Response:
        await read_body(request)
        await self._blocking(self.engine.continue_generation)
        self.paused = False
        return json_response(200, {"message": "Generation continued successfully.", "status": "ok"})

    async def release_memory(self, request: Request) -> Response:
        """SGLang's /release_memory_occupation: {"tags": [...] | null}; 200 with a null body, as SGLang."""
        return await self._memory_call(request, self.engine.release_memory_occupation)

    async def resume_memory(self, request: Request) -> Response:
        return await self._memory_call(request, self.engine.resume_memory_occupation)

    async def _memory_call(self, request: Request, fn: Callable) -> Response:
        tags = want(await read_json(request), "tags", list, None)
        try:
            await self._blocking(fn, tags)
        except (ValueError, RuntimeError) as e:  # unknown tags; requests still running
            raise HTTPError(400, str(e)) from None
        return json_response(200, None)


def serve(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    max_body_bytes: int = 64 << 20,
    **kwargs: Any,
) -> RolloutServer:
    """Start serving `engine` in a background thread; returns the server (`.url`, `.shutdown()`)."""
    return RolloutServer(engine, host, port, api_key, max_body_bytes, **kwargs).start()
