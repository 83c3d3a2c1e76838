"""The embedded rollout engine: `sglang.Engine`'s Python API with our FP4 numerics, on CPU or CUDA.

    Engine(model_path=..., quantization="nvfp4", kv_cache_dtype="nvfp4")
        .generate(input_ids=[[...], ...], sampling_params={...}, return_logprob=True)
        -> [{"output_ids": [...], "meta_info": {"output_token_logprobs": [(lp, tok, None), ...], ...}}]
Requests join the running batch between decode steps. A caller that submits and waits (`generate`,
`submit_all(drive=True)` + `wait`: the in-process rollout) runs the steps on its own thread, the worker
thread only those nobody drives (the HTTP server's): a second libgomp pool, on the worker, made libgomp
see more threads than cores and park its workers, so every parallel region of a step paid a 30-250 us
wake-up (a 32-row 1152x896 GEMM: 120 us on the main thread, 250 us on a second one).
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from megatron_trace.guidance import GuidanceRecord, resolve_guided_layers
from megatron_trace.kernels import cpu_alloc, cpu_routes
from megatron_trace.models import ModelArch, QuantPolicy
from sglang_backend.api import GenerateRequest, GenerateResult, SamplingParams, WeightBucket

from . import layer_c
from .kv_cache import PagedKVCache
from .layers import EngineLinear, streaming_status
from .loader import IGNORED_SUFFIXES, check_update, load_checkpoint, load_tensor
from .model import QwenEngineModel
from .quant_flags import check_kv_bands, policy_for
from .scheduler import Group, Scheduler, aborted_result, guidance_record, to_result

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# release/resume_memory_occupation's tags, SGLang's names; its third, "cuda_graph", holds nothing here
MEMORY_TAGS = ("weights", "kv_cache")


def memory_tags(tags) -> set[str]:
    """The tags of a release/resume call (None or empty: all, as SGLang), checked."""
    if not tags:
        return set(MEMORY_TAGS)
    if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags must be a list of strings; got {tags!r}")
    unknown = sorted(set(tags) - {*MEMORY_TAGS, "cuda_graph"})
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; allowed: weights, kv_cache, cuda_graph")
    return set(tags) & set(MEMORY_TAGS)


class Engine:
    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        quant_policy: QuantPolicy | dict | None = None,
        guidance_mode: str = "mantissa",
        guided_layers: Any = "last_half",
        max_running_requests: int = 64,
        page_size: int = 16,
        max_total_tokens: int = 65536,
        context_length: int | None = None,
        random_seed: int = 0,
        device: str = "cpu",
        **_ignored,
    ):
        self.model_path = Path(model_path)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}; got {dtype!r}")
        self.arch = ModelArch.from_hf_config(self.model_path)
        if isinstance(quant_policy, dict):
            quant_policy = QuantPolicy.from_dict(quant_policy)
        if quant_policy is not None:  # a run's policy: resolved by the run, checked here
            quant_policy.check_resolved(self.arch)
            self.policy = quant_policy
        else:  # SGLang's flags: this engine is where they become a policy
            self.policy = policy_for(quantization, kv_cache_dtype, self.model_path).resolve(self.arch)
        check_kv_bands(self.policy)
        self.model = QwenEngineModel(self.arch, self.policy, _DTYPES[dtype])
        self._released: set[str] = set()  # memory tags released (release_memory_occupation)
        self._refill: set[str] | None = None  # HF tensors a resumed model still waits for from an update
        on_cpu = self.model.embed.device.type == "cpu"
        self._allocator = cpu_alloc.keep_freed_memory() if on_cpu else None
        # what this CPU can do, decided once at start (kernels/cpu_routes.py), never by an op raising in a batch
        self.cpu_routes = cpu_routes.routes() if on_cpu else None
        load_checkpoint(self.model, self.model_path)
        self._check_static_scales()
        self._dtype = _DTYPES[dtype]
        self._kv_shape = {"num_pages": max(max_total_tokens // page_size, 1), "page_size": page_size}
        self.kv = self._new_kv()
        # what model_info says of the cache, kept while the pool itself is released
        self._kv_facts = {"fmt": self.kv.fmt, "formats": list(self.kv.side_fmt), "bpt": self.kv.bytes_per_token()}
        eos = self.arch.eos_token_id
        self.guidance_mode = guidance_mode
        self.guided = resolve_guided_layers(self.arch.num_layers, guided_layers)
        self.scheduler = Scheduler(
            self.model,
            self.kv,
            max_running=max_running_requests,
            context_length=context_length or self.arch.max_position_embeddings,
            eos_ids=eos if isinstance(eos, list) else ([eos] if eos is not None else []),
            guided_layers=self.guided,
            guidance_mode=guidance_mode,
            seed=random_seed,
        )
        self.weight_version = "0"  # a string, as SGLang's (our launcher starts SGLang with --weight-version 0 too)
        self._guidance: dict[str, GuidanceRecord] = {}
        self._results: dict[str, GenerateResult] = {}
        self._cv = threading.Condition()
        self._driven: set[str] = set()  # rids whose waiting caller runs the steps (the worker leaves them)
        self._paused = False
        self._closed = False
        self._rid = itertools.count()
        _freeze_gc(+1)
        self._gc_released = False
        self._worker = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._worker.start()

    # -- the worker ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (self._driven or not self._may_step()):
                    self._cv.wait()
                if self._closed:
                    return
                self._step()

    def _may_step(self) -> bool:
        return not self._paused and self.scheduler.has_work()

    def _step(self) -> None:
        """One scheduler step, under the lock, on the worker's or a driving caller's thread."""
        try:
            finished = self.scheduler.step()
        except Exception as e:  # a bad batch fails its requests, never the server
            self._abort_waiting(f"engine error: {e}")  # before abort_all empties `waiting`
            finished = self.scheduler.abort_all(f"engine error: {e}")
        for s in finished:
            self._results[s.rid] = self._result(s)
        if finished:  # waking the waiters every step would make them fight this thread for the GIL
            self._cv.notify_all()

    def _result(self, s) -> GenerateResult:
        """A finished sequence's result; a failure here aborts that request, never the worker."""
        try:
            handle = None
            if s.want_guidance and s.finish_reason.get("type") != "abort":
                self._guidance[s.rid] = guidance_record(s)
                handle = s.rid
            return to_result(s, self.weight_version, handle)
        except Exception as e:
            self._guidance.pop(s.rid, None)
            return aborted_result(s.rid, len(s.prompt), self.weight_version, f"engine error: {e}")

    def _abort_waiting(self, message: str) -> None:
        for g in self.scheduler.waiting:
            for rid in g.rids:
                self._results[rid] = aborted_result(rid, len(g.request.input_ids), self.weight_version, message)
        self.scheduler.waiting = []

    # -- generation ------------------------------------------------------------------------------
    def submit(self, req: GenerateRequest) -> list[str]:
        """Queue one request (n samples); returns the rids its results will carry."""
        return self.submit_all([req])[0]

    def submit_all(self, reqs: list[GenerateRequest], drive: bool = False) -> list[list[str]]:
        """Queue requests together, so one step admits them all (submitted one by one, the worker
        would start on the first few and the rest would trail a prefill behind). Validates all
        before queueing any. drive: this thread will `wait` for them and run the steps itself."""
        for req in reqs:
            self._validate(req)
        with self._cv:  # checked with the lock held: a release cannot slip in between
            if self._closed:
                raise RuntimeError("engine is shut down")
            self._check_serving()
            groups = []
            for req in reqs:
                self.scheduler.check(req)
                n = req.sampling_params.n
                base = req.rid or uuid.uuid4().hex
                groups.append(Group(req, [base] if n == 1 else [f"{base}-{i}" for i in range(n)]))
            for g in groups:
                self.scheduler.add(g)
                if drive:
                    self._driven.update(g.rids)
            self._cv.notify_all()
        return [g.rids for g in groups]

    def wait(self, rids: list[str], timeout: float | None = None) -> list[GenerateResult]:
        """The results of rids (submitted by this thread with drive=True: steps run here meanwhile)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        drive = any(r in self._driven for r in rids)
        try:
            while True:
                with self._cv:  # left between steps, so other callers can submit or update weights
                    if all(r in self._results for r in rids) or self._closed:
                        return [
                            self._results.pop(r)
                            if r in self._results
                            else aborted_result(r, 0, self.weight_version, "shutdown")
                            for r in rids
                        ]
                    if drive and self._may_step():
                        self._step()
                        continue
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"requests {rids[:3]} did not finish in {timeout} s")
                    self._cv.wait(left)
        finally:
            if drive:
                with self._cv:
                    self._driven.difference_update(rids)
                    self._cv.notify_all()  # the worker takes over what is left

    def _validate(self, req: GenerateRequest) -> None:
        ids = req.input_ids
        if not ids:
            raise ValueError("input_ids must be a non-empty list of token ids")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.arch.vocab_size]
        if bad:
            raise ValueError(f"input_ids hold tokens outside the vocabulary [0, {self.arch.vocab_size}): {bad[:5]}")
        if len(ids) >= self.scheduler.context_length:
            raise ValueError(f"prompt has {len(ids)} tokens; the context length is {self.scheduler.context_length}")
        if req.return_guidance and not self.policy.guided_site_kinds():
            p = self.policy
            raise ValueError(
                f"guidance records quantized sites, and this engine has none (format {p.format}, activations "
                f"{p.activations}, K {p.k_format}, V {p.v_format}): serve FP4 activations or a quantized KV cache"
            )
        if req.return_routed_experts and not self.arch.is_moe:
            raise ValueError(f"return_routed_experts needs an MoE model; {self.model_path} is {self.arch.family}")

    def generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        return_logprob: bool = False,
        rid=None,
        return_guidance: bool = False,
        return_routed_experts: bool = False,
        **_ignored,
    ):
        """sglang.Engine.generate: a dict for one input, a list for a batch (n>1: n per prompt)."""
        if prompt is not None:
            raise ValueError("the embedded engine has no tokenizer: pass input_ids")
        if input_ids is None:
            raise ValueError("generate needs input_ids")
        single = not input_ids or isinstance(input_ids[0], int)
        batch = [input_ids] if single else list(input_ids)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(batch)
        rids = rid if isinstance(rid, list) else [rid] * len(batch)
        if len(params) != len(batch) or len(rids) != len(batch):
            raise ValueError("sampling_params and rid lists must match the number of prompts")
        reqs = [
            GenerateRequest(
                list(ids),
                p if isinstance(p, SamplingParams) else SamplingParams.from_dict(p),
                r,
                return_logprob,
                return_guidance,
                return_routed_experts,
            )
            for ids, p, r in zip(batch, params, rids)
        ]
        all_rids = self.submit_all(reqs, drive=True)
        out = [r.to_sglang(return_logprob) for r in self.wait([r for rs in all_rids for r in rs])]
        return out[0] if single and len(out) == 1 else out

    def fetch_guidance(self, handle: str) -> GuidanceRecord:
        with self._cv:
            if handle not in self._guidance:
                raise KeyError(f"no guidance record {handle!r} (never requested, or already fetched)")
            return self._guidance.pop(handle)

    # -- control ---------------------------------------------------------------------------------
    def pause_generation(self) -> None:
        with self._cv:
            self._paused = True

    def continue_generation(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def flush_cache(self) -> bool:
        """Drop cached KV; refused (False) while requests run, as SGLang does."""
        with self._cv:
            if self.scheduler.has_work():
                return False
            if self.kv is not None:  # a released pool holds nothing
                self.kv.free_pages = list(range(self.kv.num_pages - 1, -1, -1))
            return True

    def update_weights_from_tensor(
        self, named_tensors, load_format=None, flush_cache: bool = True, weight_version: str | int | None = None
    ) -> tuple[bool, str]:
        """Load HF-named tensors (BF16 or ModelOpt NVFP4) between decode steps; all or nothing: the
        whole update is checked before any of it is written (loader.check_update), so a refused one
        leaves the served version as it was without a copy of the model to restore."""
        named = list(named_tensors.items()) if isinstance(named_tensors, dict) else list(named_tensors)
        with self._cv:
            if self.model is None:
                return False, (
                    "refused: the weights are released (release_memory_occupation); "
                    "resume_memory_occupation(['weights']) first, as SGLang requires"
                )
            try:
                check_update(self.model, named)
            except ValueError as e:
                return False, f"refused: {e}; still serving version {self.weight_version}"
            touched = {}
            for name, t in named:
                lin = load_tensor(self.model, name, t)
                if lin is not None:
                    touched[id(lin)] = lin
            for lin in touched.values():
                lin.finalize()
            if weight_version is not None:
                self.weight_version = str(weight_version)
            self._check_static_scales()
            if self._refill is not None:
                self._refill.difference_update(name for name, _ in named)
                self._refill = self._refill or None
            if flush_cache and self.kv is not None and not self.scheduler.has_work():
                self.kv.free_pages = list(range(self.kv.num_pages - 1, -1, -1))
        return True, f"loaded {len(named)} tensors; serving version {self.weight_version}"

    def update_weights_from_bucket(self, bucket: WeightBucket, flush_cache: bool = True) -> tuple[bool, str]:
        return self.update_weights_from_tensor(bucket.tensors, flush_cache=flush_cache, weight_version=bucket.version)

    def _check_static_scales(self) -> None:
        """quant.activation_scale=static needs each FP4-activation linear's input_scale (a calibrated
        checkpoint or bucket); until one arrives such a linear rounds its input per token. Say so
        loudly, and keep the list in get_model_info()["static_scales_missing"]."""
        missing = []
        if self.policy.activation_scale == "static":
            missing = [
                m.site
                for m in self.model.modules()
                if isinstance(m, EngineLinear) and m.act_fmt == "nvfp4" and m.input_global_scale is None
            ]
        if missing and missing != getattr(self, "static_scales_missing", None):
            log.warning(
                "quant.activation_scale=static, but %d FP4-activation linears have no input_scale yet (%s%s): "
                "they quantize their inputs per token until a weight update brings one",
                len(missing),
                ", ".join(missing[:3]),
                ", ..." if len(missing) > 3 else "",
            )
        self.static_scales_missing = missing

    def get_model_info(self) -> dict[str, Any]:
        return {
            "model_path": str(self.model_path),
            "weight_version": str(self.weight_version),
            "is_generation": True,
            "architectures": [self.arch.family],
            "quant_policy": self.policy.to_dict(),
            "kv_cache_dtype": self._kv_facts["fmt"],
            "kv_formats": list(self._kv_facts["formats"]),
            "kv_bytes_per_token": self._kv_facts["bpt"],
            "memory_released": sorted(self._released),
            "guided_layers": self.guided,
            "guidance_mode": self.guidance_mode,
            "static_scales_missing": list(self.static_scales_missing),
            # what CPU decode linears run on: cpu_gemv/<isa>, or torch (why the kernels are missing)
            "cpu_linear": streaming_status() if self._allocator else None,
            # what this CPU can do, decided once (kernels/cpu_routes.py): kernel ISA, bf16 GEMM route, packing
            "cpu_routes": self.cpu_routes.describe() if self.cpu_routes else None,
            "cpu_allocator": self._allocator,
            # how decode runs each layer (run_plan): a layout the C calls do not take shows as "per kernel"
            "cpu_layers": self.model.run_plan(self.kv).describe() if self._allocator and not self._released else None,
        }

    # -- colocated memory (SGLang's release_memory_occupation / resume_memory_occupation) -----------
    def release_memory_occupation(self, tags: list[str] | None = None) -> float:
        """Give the KV pool ("kv_cache") and/or the weights ("weights") back to the system while a
        colocated trainer trains (tags as SGLang's; none: both); returns the GiB the heap returned.
        Refused while requests run or wait (SGLang asserts an idle engine). Until
        resume_memory_occupation, and for weights until an update has refilled every tensor,
        generation is refused: a released engine never serves zeros."""
        tags = memory_tags(tags)
        with self._cv:
            if self.scheduler.has_work():
                raise RuntimeError(
                    f"release_memory_occupation needs an idle engine: {len(self.scheduler.running)} sequences "
                    f"run and {len(self.scheduler.waiting)} requests wait"
                )
            if "kv_cache" in tags:
                self.kv = self.scheduler.kv = None
                if self.model is not None:  # the run plan and the layers' C arguments hold the pool's views
                    self.model.__dict__.pop("_plan_for", None)
                    layer_c.forget(self.model.layers)
            if "weights" in tags:
                self.model = self.scheduler.model = None
                self._refill = None
            self._released |= tags
        if self._allocator is None and torch.cuda.is_available():
            torch.cuda.empty_cache()  # freed blocks stay with the caching allocator until given back
        return cpu_alloc.return_freed_memory() / 2**30

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Allocate what release_memory_occupation gave back: an empty KV pool; a model whose
        tensors the next weight update must all refill (generation is refused until it has)."""
        tags = memory_tags(tags)
        with self._cv:
            if "weights" in tags and self.model is None:
                self.model = self.scheduler.model = QwenEngineModel(self.arch, self.policy, self._dtype)
                self._refill = {n for n in self.arch.hf_param_shapes() if not n.endswith(IGNORED_SUFFIXES)}
            if "kv_cache" in tags and self.kv is None:
                self.kv = self.scheduler.kv = self._new_kv()
            self._released -= tags

    def _new_kv(self) -> PagedKVCache:
        return PagedKVCache(
            num_layers=self.arch.num_layers,
            kv_heads=self.arch.num_kv_heads,
            head_dim=self.arch.head_dim,
            kv_dtype="auto",
            k_dtype=self.policy.k_format,
            v_dtype=self.policy.v_format,
            dtype=self._dtype,
            **self._kv_shape,
        )

    def _check_serving(self) -> None:
        if self._released:
            raise RuntimeError(
                f"the engine's {' and '.join(sorted(self._released))} memory is released "
                "(release_memory_occupation): resume_memory_occupation before generating"
            )
        if self._refill:
            raise RuntimeError(
                f"the engine's weights were resumed but {len(self._refill)} tensors have not been refilled by a "
                f"weight update since (e.g. {sorted(self._refill)[:2]}): push a full weight version first"
            )

    def is_alive(self) -> bool:
        return not self._closed and self._worker.is_alive()

    def shutdown(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._worker.join(timeout=10)
        if not self._gc_released:
            self._gc_released = True
            _freeze_gc(-1)


_live_engines = [0]


def _freeze_gc(delta: int) -> None:
    """While engines run, the objects that existed at start-up are out of the cyclic GC's sight:
    each decode step allocates hundreds of tensors, and every collection would otherwise walk the
    whole long-lived model and library object graph (SGLang freezes too). The last shutdown thaws
    them, so their finalizers run at exit as usual."""
    with _GC_LOCK:
        _live_engines[0] += delta
        if delta > 0 and _live_engines[0] == 1:
            gc.collect()
            gc.freeze()
        elif delta < 0 and _live_engines[0] == 0:
            gc.unfreeze()


_GC_LOCK = threading.Lock()
