"""SGLang plugin entry point: `[sglang.srt.plugins] trace_fp4 = sglang_backend.plugin.register:register`.

Targets SGLang 0.5.23. `sglang.srt.plugins.load_plugins()` (called by `python -m
sglang.launch_server` before it parses the CLI, and early in every SGLang process; filter with
SGLANG_PLUGINS=trace_fp4) calls `register()`, which, each step guarded and logged when this
SGLang lacks the hook:

1. quantization: puts `trace_fp4` (ModelOpt NVFP4 exports), `trace_nvfp4` / `trace_mxfp4` (online
   quantization of a BF16 checkpoint, plugin/online_quant.py) at the FRONT of
   `sglang.srt.layers.quantization.QUANTIZATION_METHODS` (the dict is mutated in place, never
   rebound). ModelConfig._verify_quantization asks each config's override_quantization_method
   in dict order and takes the first answer; ModelOpt's own configs would otherwise claim our
   exported NVFP4 checkpoints before we are asked.
2. CLI: `sglang.srt.server_args.add_quantization_method_choices` (or QUANTIZATION_CHOICES).
3. KV cache: SGLang's NVFP4 KV method with TRACE's quantize_and_store replaces the `nvfp4` entry
   of KV_CACHE_QUANT_REGISTRY (TRACE_FP4_KV=0 keeps SGLang's); with TRACE_KV_SIDES=<k>,<v> the
   entry stores K and V in their own formats (kv_sides.py), K de-biased with TRACE_KV_K_DEBIAS=1
   (kv_debias.py: an AROUND hook on ModelRunner.forward hands the store the batch's positions).
4. HTTP: `POST /get_guidance {"rid"}` on `sglang.srt.entrypoints.http_server.app` (main process
   only): the GuidanceRecord bytes, 404 JSON for an unknown or already-fetched rid; `GET /trace_policy`:
   the K/V formats, de-biased K and guided layers this plugin serves (api.TRACE_POLICY_PATH).
5. Capture (slot_capture.py, SGLang's state-capturer shape): an AROUND hook on ModelRunner.forward
   gives guided linears the batch's KV slots; an AFTER hook on the finish of each request
   (SchedulerBatchResultProcessor._maybe_collect_routed_experts) publishes its record.
6. Weight updates: AROUND hooks check a whole update against the checkpoint's first load before
   any tensor is loaded (weight_check.py).
7. Routed experts on the CPU engine: host buffers unpinned where CUDA is absent
   (routed_experts_cpu.py), so --enable-return-routed-experts starts there.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import sys

from .. import plugin_settings as settings
from ..api import TRACE_POLICY_PATH, trace_policy_of
from . import kv_debias, kv_read, kv_sides, routed_experts_cpu, slot_capture, weight_check
from .kv_capture import sglang_nvfp4_base
from .online_quant import TraceMXFP4OnlineConfig, TraceNVFP4OnlineConfig
from .quant_config import TraceFP4Config, set_active

log = logging.getLogger(__name__)

TARGET_SGLANG_VERSION = "0.5.23"
CONFIGS = {
    TraceFP4Config.NAME: TraceFP4Config,
    TraceNVFP4OnlineConfig.NAME: TraceNVFP4OnlineConfig,
    TraceMXFP4OnlineConfig.NAME: TraceMXFP4OnlineConfig,
}
FORWARD_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
# called for every finishing request before its KV is released (routed experts are collected there)
FINISH_TARGET = (
    "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor."
    "_maybe_collect_routed_experts"
)


def _import(name: str):
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any failure means "this SGLang lacks it"
        log.warning("trace_fp4: cannot import %s (%s: %s)", name, type(e).__name__, e)
        return None


def register_quantization() -> bool:
    mod = _import("sglang.srt.layers.quantization")
    methods = getattr(mod, "QUANTIZATION_METHODS", None) if mod else None
    if not isinstance(methods, dict):
        log.warning(
            "trace_fp4: this SGLang has no QUANTIZATION_METHODS dict (targeted %s); quantization "
            "'trace_fp4' is NOT registered",
            TARGET_SGLANG_VERSION,
        )
        return False
    rest = [(k, v) for k, v in methods.items() if k not in CONFIGS]
    methods.clear()  # same dict object, ours first: see the module docstring
    methods.update(CONFIGS)
    methods.update(rest)
    return True


def register_cli_choices() -> bool:
    mod = _import("sglang.srt.server_args")
    if mod is None:
        return False
    choices = getattr(mod, "QUANTIZATION_CHOICES", None)
    missing = [n for n in CONFIGS if not (isinstance(choices, list) and n in choices)]
    add = getattr(mod, "add_quantization_method_choices", None)
    if callable(add):
        if missing:
            add(missing)
        return True
    if isinstance(choices, list):
        choices.extend(missing)
        return True
    log.warning(
        "trace_fp4: server_args has neither add_quantization_method_choices nor QUANTIZATION_CHOICES; "
        "--quantization trace_fp4 may be rejected by the CLI"
    )
    return False


def _refusing_kv_method(message: str):
    """A registry entry that stops the server when it builds its KV pool: K/V formats that were asked
    for and cannot be served must not turn into SGLang's NVFP4 for both sides."""

    def refuse(*_args, **_kwargs):
        raise RuntimeError(f"trace_fp4 KV cache: {message}")

    return refuse


def register_kv_method() -> bool:
    _, mod = sglang_nvfp4_base()
    try:
        sides = kv_sides.sides_from_env()
    except ValueError as e:
        if mod is not None:
            mod.KV_CACHE_QUANT_REGISTRY["nvfp4"] = _refusing_kv_method(str(e))
        raise
    debias = settings.current().kv_k_debias
    if debias and sides is None and mod is not None:
        mod.KV_CACHE_QUANT_REGISTRY["nvfp4"] = _refusing_kv_method(
            f"{settings.env_name('kv_k_debias')}=1 needs {kv_sides.SIDES_ENV}=<k>,<v> (the per-side method "
            "de-biases K; sglang_backend.launch --kv-k-debias sets both)"
        )
        return False
    per_side = sides is not None and (sides != ("nvfp4", "nvfp4") or debias)
    if not settings.current().fp4_kv:
        if per_side and mod is not None:
            mod.KV_CACHE_QUANT_REGISTRY["nvfp4"] = _refusing_kv_method(
                f"{settings.env_name('fp4_kv')}=0 keeps SGLang's nvfp4 method, which stores K and V alike; "
                f"{kv_sides.SIDES_ENV}={','.join(sides)} needs the plugin's"
            )
            return False
        log.info("trace_fp4: %s=0, SGLang's nvfp4 KV method is kept", settings.env_name("fp4_kv"))
        return False
    # + plain dequantized reads for torch_native (kv_read.py); per-side formats: kv_sides.py
    cls = kv_sides.per_side_method_class(sides, debias) if per_side else kv_read.plain_read_method_class()
    if mod is None or cls is None:
        log.warning(
            "trace_fp4: no KV_CACHE_QUANT_REGISTRY with an NVFP4 method in this SGLang; nvfp4 KV writes "
            "use SGLang's quantizer and are not captured%s",
            f", and {kv_sides.SIDES_ENV}={','.join(sides)} is NOT served" if per_side else "",
        )
        return False
    mod.KV_CACHE_QUANT_REGISTRY["nvfp4"] = cls
    return True


def guidance_answer(body) -> tuple[int, bytes | dict]:
    """POST /get_guidance {"rid"}: (200, the GuidanceRecord bytes) or (status, {"error": ...}); the same
    body and answer as the embedded server's. A record is handed out once."""
    rid = body.get("rid") if isinstance(body, dict) else None
    if not isinstance(rid, str):
        return 400, {"error": 'body must be {"rid": "<request id>"}'}
    try:
        return 200, slot_capture.take(rid)
    except KeyError as e:
        return 404, {"error": str(e.args[0])}
    except ValueError as e:
        return 400, {"error": str(e)}
    except RuntimeError as e:
        return 500, {"error": f"guidance of request {rid!r} was not captured: {e}"}


def served_policy() -> dict:
    """GET /trace_policy: what this server's plugin stores and records (the embedded server answers alike)."""
    s = settings.current()
    # without TRACE_KV_SIDES SGLang's one --kv-cache-dtype decides, which the plugin is not told
    fmt = s.kv_sides or ("unknown", "unknown")
    return trace_policy_of(fmt, s.kv_k_debias and s.kv_sides is not None, s.guided_layers, s.guidance_mode)


def register_http_route(app=None) -> bool:
    if app is None:
        if multiprocessing.parent_process() is not None:
            return False  # scheduler/detokenizer processes serve no HTTP
        mod = _import("sglang.srt.entrypoints.http_server")
        app = getattr(mod, "app", None) if mod else None
    if app is None or not hasattr(app, "post"):
        log.warning(
            "trace_fp4: no FastAPI app at sglang.srt.entrypoints.http_server.app; POST /get_guidance is not served"
        )
        return False
    if any(getattr(r, "path", None) == "/get_guidance" for r in getattr(getattr(app, "router", None), "routes", [])):
        return True
    app.get(TRACE_POLICY_PATH)(served_policy)

    async def get_guidance(request):
        from fastapi.responses import JSONResponse, Response

        try:
            body = await request.json()
        except ValueError:
            body = None
        status, out = guidance_answer(body)
        if status == 200:
            return Response(content=out, media_type="application/octet-stream")
        return JSONResponse(out, status_code=status)

    from fastapi import Request

    get_guidance.__annotations__ = {"request": Request}
    app.post("/get_guidance")(get_guidance)
    return True


def register_capture_hook() -> bool:
    mod = _import("sglang.srt.plugins.hook_registry")
    reg, kinds = (getattr(mod, "HookRegistry", None), getattr(mod, "HookType", None)) if mod else (None, None)
    if reg is None or kinds is None:
        log.warning("trace_fp4: no HookRegistry in this SGLang; guidance is not captured")
        return False
    reg.register(FORWARD_TARGET, slot_capture.forward_with_capture, kinds.AROUND)
    reg.register(FORWARD_TARGET, kv_debias.forward_with_positions, kinds.AROUND)
    reg.register(FINISH_TARGET, slot_capture.on_request_finished, kinds.AFTER)
    for target in kv_read.ARGS_HOOK_TARGETS:
        reg.register(target, kv_read.allow_plain_backends, kinds.AROUND)
    reg.register(kv_read.FP4_DTYPE_TARGET, kv_read.fp4_dtype_anywhere, kinds.AROUND)
    return True


def register_weight_check() -> bool:
    """Weight updates are checked against the first load before anything is loaded (weight_check.py)."""
    mod = _import("sglang.srt.plugins.hook_registry")
    reg, kinds = (getattr(mod, "HookRegistry", None), getattr(mod, "HookType", None)) if mod else (None, None)
    if reg is None or kinds is None:
        log.warning("trace_fp4: no HookRegistry in this SGLang; weight updates are NOT checked before loading")
        return False
    reg.register(weight_check.LOAD_TARGET, weight_check.record_first_load, kinds.AROUND)
    for target, fn in weight_check.HOOK_TARGETS.items():
        reg.register(target, getattr(weight_check, fn), kinds.AROUND)
    return True


def register() -> dict[str, bool]:
    """Run every registration step; returns which succeeded (each failure is logged)."""
    done = {}
    for name, step in (
        ("quantization", register_quantization),
        ("cli_choices", register_cli_choices),
        ("kv_cache", register_kv_method),
        ("http_route", register_http_route),
        ("capture_hook", register_capture_hook),
        ("weight_check", register_weight_check),
        ("cpu_routed_experts", routed_experts_cpu.allow_unpinned_cpu_host_buffers),
    ):
        try:
            done[name] = bool(step())
        except Exception:  # noqa: BLE001 - a plugin must not take the server down with it
            log.exception("trace_fp4: registration step %s failed", name)
            done[name] = False
    set_active(done["quantization"])
    version = getattr(sys.modules.get("sglang"), "__version__", "unknown")
    log.info("trace_fp4 plugin registered on SGLang %s (targeted %s): %s", version, TARGET_SGLANG_VERSION, done)
    return done
