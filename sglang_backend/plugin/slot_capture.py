"""Guidance capture inside a real SGLang server, in the shape of SGLang's per-token state capturers.

`sglang/srt/state_capturer/base.py` keeps a host cache indexed by KV slot (`out_cache_loc`),
writes each forward's rows there and, when a request finishes, reads its rows back through
`req_to_token[req_pool_idx, :seqlen - 1]`. Guidance does the same: `SlotCapture` holds, per
guided site, the packed codes, block-scale bytes (NVFP4: E4M3 and S_enc; MXFP4: E8M0, S_enc 1.0)
of the token in each KV slot; the quant methods write into it (`capture.record` -> `write`)
while the AROUND hook on `ModelRunner.forward` has the batch's `out_cache_loc` in place; the AFTER hook on
`SchedulerBatchResultProcessor._maybe_collect_routed_experts` (SGLang calls it for every request that
finishes, before its KV is released) gathers the request's rows and builds the record with the
project's one record format (`megatron_trace.guidance.encode_records`).

Slot indexing is what makes the radix cache and `n > 1` right: a prefix computed once (SGLang
prefills it in a warm-up request before the n samples) lives in KV slots every request that
reuses it points to, and so do its guidance rows. Writes are `index_copy_` into tensors
allocated up front, so a CUDA graph that captured them keeps writing into the same storage.

At SGLang TP > 1 every rank's capture assembles TP=1's rows (`assemble_at_tp`: row-parallel K
chunks and K/V heads all-gathered in the forward) and TP rank 0 alone publishes the record.

The record leaves the model process through a directory (shared memory by default): the
scheduler `publish`es the bytes under the request's rid, the HTTP route (`/get_guidance`, the
same body and answer as the embedded server's) pops them. Requests opt in with
`sampling_params.custom_params = {"trace_return_guidance": true}` (SGLang's own private
transport to the scheduler; unknown top-level keys of /generate are dropped).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path

import torch

from megatron_trace.fp4 import FP8Tensor, MXFP4Tensor, NVFP4Tensor
from megatron_trace.guidance import encode_records, make_site, quantized_parts
from megatron_trace.guidance.record import KV_SITES, layer_of
from sglang_backend.api import GUIDANCE_KEY  # in sampling_params.custom_params

from .. import plugin_settings as settings
from . import capture
from .layer_tp import kv_heads_all_gather, row_parallel_all_gather

log = logging.getLogger(__name__)

_SAFE_RID = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")


class SlotCapture:
    """Per guided site: codes [capacity + 1, K/2], scales [.., K/16] (E4M3; MXFP4 sites: E8M0 [.., K/32],
    K/V [.., heads, D/16]), S_enc [..]; row `capacity` is the dump."""

    def __init__(self, capacity: int, mode: str, guided_layers, device: torch.device | str = "cpu"):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1; got {capacity}")
        self.capacity, self.mode, self.device = capacity, mode, torch.device(device)
        self.guided = set(guided_layers)
        self.sites: dict[str, dict[str, torch.Tensor]] = {}  # first-write order = the record's site order
        self.static: dict[str, float | None] = {}  # one static S_enc for every row so far, else None
        self.error: str | None = None
        # At SGLang TP > 1 (assemble_at_tp): site -> function turning this rank's rows into the full rows
        # (row-parallel K chunks, K/V heads), run in every rank's forward; only TP rank 0 publishes.
        self.gathers: dict[str, object] = {}
        self.tp_rank = 0

    def write(self, site: str, slots: torch.Tensor, positions, q: NVFP4Tensor | MXFP4Tensor | FP8Tensor) -> None:
        """q: the [T, ..., K] quantized input of `site` (K/V sites are [T, heads, head_dim]); row t belongs
        to KV slot slots[t]. Kept as `guidance.quantized_parts` names q's parts (MXFP4: a static S_enc
        of 1.0; FP8 K/V: S_enc per token, no block scales), as the embedded engine's guidance log keeps
        them, so both stacks write one record."""
        if layer_of(site) not in self.guided:
            return
        if q.data.dim() < 2 or slots.shape[0] != q.data.shape[0]:
            self.error = (
                f"{site}: {q.data.shape[0]} quantized rows but {slots.shape[0]} token slots in the "
                "batch (padded or split batches are not captured)"
            )
            return
        scales, gs, codes = quantized_parts(q)
        gather = self.gathers.get(site)
        if gather is not None:  # a collective: every TP rank reaches it for the same site and batch
            # MXFP4 blocks never straddle ranks (K per rank and head_dim are whole blocks) and carry no
            # per-token scale; FP8's per-token S_enc is already the MAX over the ranks' heads: so the
            # gathered bytes are TP=1's for every format
            codes, scales = gather(codes), gather(scales)
        s = self.sites.get(site)
        if s is None:
            rows = self.capacity + 1
            s = self.sites[site] = {
                "codes": torch.zeros(rows, *codes.shape[1:], dtype=torch.uint8, device=self.device),
                "scales": torch.zeros(rows, *scales.shape[1:], dtype=torch.uint8, device=self.device),
                # per token [rows], or per routed slot [rows, top_k] (the routed experts' down_proj site)
                "gs": torch.zeros(rows, *gs.shape[1:], dtype=torch.float32, device=self.device),
            }
            self.static[site] = float(gs) if gs.dim() == 0 else None
        loc = slots.to(device=self.device, dtype=torch.long)
        loc = torch.where((loc >= 0) & (loc < self.capacity), loc, torch.full_like(loc, self.capacity))
        gs = gs.to(device=self.device, dtype=torch.float32)
        if gs.dim() == 0 and self.static[site] is not None and float(gs) != self.static[site]:
            self.static[site] = None  # a re-synced static scale: rows keep the S_enc they were quantized with
        elif gs.dim():
            self.static[site] = None
        s["codes"].index_copy_(0, loc, codes.to(self.device))
        s["scales"].index_copy_(0, loc, scales.to(self.device))
        s["gs"].index_copy_(0, loc, gs.expand(loc.shape[0], *s["gs"].shape[1:]) if gs.dim() == 0 else gs)

    def record(self, rid: str, slots: torch.Tensor) -> bytes:
        """The GuidanceRecord bytes of a request whose positions sit in KV slots `slots` (in order)."""
        if self.error is not None:
            raise RuntimeError(f"guidance capture failed: {self.error}")
        if not self.sites:
            raise RuntimeError(
                "no guided quantized site ran in this server (guided layers "
                f"{sorted(self.guided)}; are they FP4 under the server's quantization?)"
            )
        idx = slots.to(device=self.device, dtype=torch.long)
        if bool(((idx < 0) | (idx >= self.capacity)).any()):
            raise RuntimeError(f"request {rid}: KV slots outside the capture's {self.capacity} rows")
        sites = {}
        for name, s in sorted(self.sites.items(), key=_record_order):
            static = self.static[name]
            gs = torch.tensor(static, dtype=torch.float32) if static is not None else s["gs"].index_select(0, idx)
            sites[name] = make_site(
                s["scales"].index_select(0, idx).cpu(), gs.cpu(), s["codes"].index_select(0, idx).cpu(), self.mode
            )
        return encode_records([rid], self.mode, [int(idx.shape[0])], sites)[0]


def _record_order(item) -> tuple[int, bool]:
    """Sites by layer, a layer's K/V cache sites after its linears (the embedded engine's record order;
    SGLang writes K/V between the attention and MLP linears). sorted() keeps first-write order within."""
    name = item[0]
    return layer_of(name), name.rsplit(".", 1)[-1] in KV_SITES


# -- the record's way out of the model process -------------------------------------------------
def _path(rid: str, directory, suffix: str) -> Path:
    if not isinstance(rid, str) or not _SAFE_RID.match(rid):
        raise ValueError(f"rid must match {_SAFE_RID.pattern}; got {rid!r}")
    return capture.guidance_dir(directory) / f"{rid}{suffix}"


def publish(rid: str, data: bytes | None, error: str | None = None, directory=None) -> Path:
    """Write a finished request's record bytes (or why there is none) where the route finds them."""
    out = _path(rid, directory, ".rec" if error is None else ".err")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data if error is None else error.encode())
    os.replace(tmp, out)
    return out


def take(rid: str, directory=None) -> bytes:
    """Pop the record published for `rid`: KeyError if none (unknown or already fetched), RuntimeError
    with the capture's message if it failed."""
    rec, err = _path(rid, directory, ".rec"), _path(rid, directory, ".err")
    for p in (rec, err):
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            continue
        p.unlink(missing_ok=True)
        if p is err:
            raise RuntimeError(data.decode(errors="replace"))
        return data
    raise KeyError(f"no guidance record for request {rid!r} (unknown rid, not asked for, or already fetched)")


# -- SGLang hooks (run in the scheduler / model process) ----------------------------------------
def guided_layers_from_env() -> list[int] | None:
    layers = settings.current().guided_layers
    return None if layers is None else list(layers)


def ensure_capture(runner) -> SlotCapture | None:
    """The process's SlotCapture, made on the first forward from the runner's KV pool size."""
    cur = capture.get_capture_buffer()
    if cur is not None:
        return cur
    layers = guided_layers_from_env()
    if not layers:
        return None
    pool = runner.token_to_kv_pool
    capacity = int(pool.size) + int(getattr(runner, "page_size", 1) or 1) + 1
    device = getattr(runner, "device", "cpu")
    cap = SlotCapture(capacity, settings.current().guidance_mode, layers, device=device)
    from sglang.srt.runtime_context import get_parallel  # SGLang 0.5.23: the runner keeps no tp_size

    if int(get_parallel().tp_size) > 1:
        assemble_at_tp(cap, runner.model, get_parallel(), runner.model_config.get_total_num_kv_heads())
    method = getattr(pool, "quant_method", None)
    if (
        getattr(pool, "is_quantized_kv_cache", False)
        and not getattr(method, "records_guidance", False)
        and cap.error is None
    ):
        cap.error = (
            f"the KV cache method {type(method).__name__} does not record guidance of the FP4 K/V sites "
            "(k_cache/v_cache); the plugin's KV methods do: its nvfp4 method (TRACE_FP4_KV=0 keeps SGLang's, "
            f"which does not) and the per-side method of {settings.env_name('kv_sides')} (the launcher's "
            "MXFP4 KV on the CPU engine; on GPUs --kv-cache-dtype mxfp4 is SGLang's fp4_mx_block16, which does not)"
        )
    capture.set_capture_buffer(cap)
    log.info("trace_fp4: guidance capture for layers %s, %d KV slots, mode %s", layers, capacity, cap.mode)
    return cap


def assemble_at_tp(cap: SlotCapture, model, parallel, total_kv_heads: int) -> None:
    """Make every TP rank's capture hold TP=1's rows, so TP rank 0's record equals TP=1's record.

    Column-parallel linears (q/k/v, gate/up) see the full, replicated activation: nothing to do.
    Row-parallel linears (o_proj, down_proj) quantize their K chunk with the full row's per-token
    S_enc (quant_method.quantize_input): their codes and E4M3 scales are all-gathered along K.
    K/V cache sites hold this rank's KV heads: all-gathered along the heads, a replicated head
    (fewer KV heads than ranks) taken once. Raises for layouts where that is not the whole story."""
    tp, attn_tp = int(parallel.tp_size), int(getattr(parallel, "attn_tp_size", parallel.tp_size))
    if attn_tp != tp:
        raise NotImplementedError(
            f"guidance capture with attention TP {attn_tp} != TP {tp} (DP attention): "
            "the K/V heads of a request are not split over the TP group; run without it"
        )
    cap.tp_rank = int(parallel.tp_rank)
    for _, module in model.named_modules():
        site = getattr(module, "trace_site", None)
        gather = row_parallel_all_gather(module) if site and layer_of(site) in cap.guided else None
        if gather is not None:
            cap.gathers[module.trace_site] = gather
    heads = kv_heads_all_gather(parallel.tp_group, cap.tp_rank, tp, total_kv_heads)
    for layer in cap.guided:
        for side in KV_SITES:
            cap.gathers[f"model.layers.{layer}.self_attn.{side}"] = heads
    log.info(
        "trace_fp4: guidance at TP=%d: rank %d gathers %d guided row-parallel sites and the K/V heads",
        tp,
        cap.tp_rank,
        len(cap.gathers) - 2 * len(cap.guided),
    )


def forward_with_capture(original, self, forward_batch, *args, **kwargs):
    cap = ensure_capture(self)
    if cap is None or forward_batch.out_cache_loc is None:
        return original(self, forward_batch, *args, **kwargs)
    with capture.capture_batch(forward_batch.out_cache_loc, forward_batch.out_cache_loc):
        return original(self, forward_batch, *args, **kwargs)


def wants_guidance(req) -> bool:
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return isinstance(params, dict) and bool(params.get(GUIDANCE_KEY))


def on_request_finished(result, self, req, *args, **kwargs):
    """AFTER hook of SchedulerBatchResultProcessor._maybe_collect_routed_experts: publish req's record."""
    if not wants_guidance(req) or req.sampling_params.max_new_tokens == 0:
        return result  # max_new_tokens 0: SGLang's prefix warm-up of n > 1, not a sample
    rid = req.rid
    cap = capture.get_capture_buffer()
    if isinstance(cap, SlotCapture) and cap.tp_rank != 0:
        return result  # every rank holds the assembled rows; TP rank 0 alone publishes them
    try:
        if not isinstance(cap, SlotCapture):
            layers = f"{settings.env_name('guided_layers')}={settings.current().guided_layers!r}"
            raise RuntimeError(
                f"guidance asked for, but this server captures none ({layers}; start it with sglang_backend.launch)"
            )
        seqlen = len(req.origin_input_ids) + len(req.output_ids_through_stop)
        slots = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : seqlen - 1]
        publish(rid, cap.record(rid, slots))
    except Exception as e:  # noqa: BLE001 - the request's /get_guidance answers with the reason
        log.exception("trace_fp4: guidance of request %s failed", rid)
        publish(rid, None, error=f"{type(e).__name__}: {e}")
    return result
