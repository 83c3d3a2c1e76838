"""Token logprobs and entropy from the last hidden states, without the whole vocabulary.

    hidden [R, H] (response rows only) ──┐
    this TP rank's vocab rows W [V/TP, H] ┴─► per chunk of rows:
        z = h·Wᵀ / temperature (fp32 [c, V/TP], Megatron's vocab padding left out)
        max and Σexp all-reduced over TP ─► log-softmax of the labels; entropy
        top-k / top-p: the support found exactly without gathering the vocabulary
    backward recomputes each chunk's z: memory is one chunk's logits, never [R, V] or [T, V]
    (the GEMMs by kernels/cpu_routes.mm: in fp32 on tiles of the bf16 weight where this CPU has no
    bf16 GEMM, each product rounded to the weight's dtype as a bf16 GEMM's is)
    (keep_logits_bytes: the forward's h·Wᵀ kept in the weight's dtype for the backward when all R
    rows fit, one GEMM of four saved for that memory; the same bits either way)

`layer_spec.LogprobHead` is GPTModel's output layer: Megatron's vocab-parallel linear, which on
request returns its (TP-copied or SP-gathered) input instead of logits, so the actor feeds that to
`chunked_logprobs`. At TP1 the chunk's log-softmax is torch's own, so identical logits give the
rollout's numbers bit for bit (`sglang_backend.api`'s sampling support: ratio exactly 1). Imports
nothing of Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_trace.kernels import cpu_routes
from sglang_backend.api import keep_mask, needs_filter


@dataclass(frozen=True)
class VocabSpec:
    """How one rank's vocab rows map to tokens, and the sampling distribution's parameters."""

    vocab_start: int  # first token id of this rank's rows
    real_vocab: int  # ids at or past it are Megatron's vocab padding (never sampled)
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    chunk_bytes: int = 128 << 20  # fp32 logits held per chunk
    keep_logits_bytes: int = 0  # the forward's logits (weight's dtype) kept for the backward up to this size
    group: object = None  # the TP group (None: one rank)


def _tp(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _all_reduce(t: torch.Tensor, spec: VocabSpec, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if _tp(spec.group) > 1:
        dist.all_reduce(t, op=op, group=spec.group)
    return t


def _width(w: torch.Tensor, spec: VocabSpec) -> int:
    """This rank's real vocab rows (Megatron pads the vocab to a multiple of 128 x TP)."""
    return min(max(spec.real_vocab - spec.vocab_start, 0), w.shape[0])


class _Workspace:
    """One call's chunk buffers, which every chunk reuses (the last, shorter one their first rows): a
    chunk's logits in the weight's dtype and its fp32 logits, log-softmax and probabilities. Fresh
    [c, V/TP] tensors per chunk cost twice on CPU: the heap policy the engine needs
    (kernels/cpu_alloc.keep_freed_memory) keeps what they free and fragments under the next ones (at
    the real 0.5B's vocab the head's forward peak grew 0.9 -> 2.0 GiB over four calls), and those
    above its mmap threshold are page-faulted in anew each time. Same ops, same bits."""

    def __init__(self, rows: int, width: int, dtype: torch.dtype):
        self.lin = torch.empty(rows, width, dtype=dtype)
        self.z, self.logp, self.probs = (torch.empty(rows, width) for _ in range(3))


def _chunk_logits(
    h: torch.Tensor, w: torch.Tensor, spec: VocabSpec, ws: _Workspace, lin: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 logits of h's rows at the temperature, in the workspace: (h·Wᵀ).float() / temperature.
    lin: where h·Wᵀ goes (default: the workspace's buffer)."""
    lin = ws.lin[: len(h)] if lin is None else lin
    cpu_routes.mm(h, w[: _width(w, spec)].t(), out=lin)  # torch.mm, or fp32 where this CPU has no bf16 GEMM
    return _scaled(lin, spec, ws)


def _scaled(lin: torch.Tensor, spec: VocabSpec, ws: _Workspace) -> torch.Tensor:
    return ws.z[: len(lin)].copy_(lin).div_(spec.temperature)


def _label_mask(labels: torch.Tensor, spec: VocabSpec, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's column of each label, clamped; whether the label is on this rank)."""
    local = labels - spec.vocab_start
    mine = (local >= 0) & (local < width)
    return local.clamp(0, width - 1), mine


def _log_softmax(z: torch.Tensor, spec: VocabSpec, out: torch.Tensor | None = None) -> torch.Tensor:
    if _tp(spec.group) == 1:
        return torch.log_softmax(z, dim=-1, out=out)  # torch's: the rollout's sampler computes exactly this
    m = z.amax(-1) if z.shape[-1] else torch.full(z.shape[:1], float("-inf"), device=z.device)
    m = _all_reduce(m, spec, dist.ReduceOp.MAX)
    s = _all_reduce(torch.exp(z - m[:, None]).sum(-1), spec)
    return torch.sub(z, (m + torch.log(s))[:, None], out=out)


def _support(probs: torch.Tensor, spec: VocabSpec) -> torch.Tensor | None:
    """bool [c, V/TP]: the tokens top-k / top-p keep (None: no filter), as `keep_mask` would find
    them on the gathered rows. Top-k: the k-th largest probability from every rank's local top-k.
    Top-p: a token in the global nucleus has less than top_p of mass before it on its own rank too,
    so each rank's such candidates, gathered, hold the whole nucleus and everything ranked before
    any of its members; the nucleus is then computed on them in the global stable order."""
    vocab = spec.real_vocab
    if not needs_filter(spec.top_k, spec.top_p, 0.0, vocab):
        return None
    if _tp(spec.group) == 1:
        return keep_mask(probs, spec.top_k, spec.top_p)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if spec.top_k != -1 and spec.top_k < vocab:
        local = torch.full((probs.shape[0], spec.top_k), -1.0, dtype=probs.dtype, device=probs.device)
        k = min(spec.top_k, probs.shape[-1])
        local[:, :k] = torch.topk(probs, k, dim=-1).values
        parts = [torch.empty_like(local) for _ in range(_tp(spec.group))]
        dist.all_gather(parts, local.contiguous(), group=spec.group)
        kth = torch.topk(torch.cat(parts, -1), spec.top_k, dim=-1).values[:, -1:]
        keep &= probs >= kth
    if spec.top_p < 1.0:
        keep &= _nucleus(torch.where(keep, probs, torch.zeros((), dtype=probs.dtype)), spec)
    return keep


def _nucleus(probs: torch.Tensor, spec: VocabSpec) -> torch.Tensor:
    rows, width = probs.shape
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = torch.cumsum(sorted_p, -1) - sorted_p
    count = torch.tensor([int((before < spec.top_p).sum(-1).max())], dtype=torch.long)
    c = int(_all_reduce(count, spec, dist.ReduceOp.MAX))
    vals = torch.full((rows, c), -1.0, dtype=probs.dtype)
    ids = torch.full((rows, c), -1, dtype=torch.long)
    cand = before[:, :c] < spec.top_p
    vals[:, : min(c, width)] = torch.where(cand, sorted_p[:, :c], torch.full_like(sorted_p[:, :c], -1.0))
    ids[:, : min(c, width)] = order[:, :c] + spec.vocab_start
    world = _tp(spec.group)
    gv, gi = [torch.empty_like(vals) for _ in range(world)], [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(gv, vals, group=spec.group)
    dist.all_gather(gi, ids, group=spec.group)
    allv, alli = torch.cat(gv, -1), torch.cat(gi, -1)
    by_id = torch.argsort(torch.where(allv < 0, torch.iinfo(torch.long).max, alli), dim=-1, stable=True)
    allv, alli = allv.gather(-1, by_id), alli.gather(-1, by_id)
    srt, o = torch.sort(allv, dim=-1, descending=True, stable=True)  # ties: lower token id first
    kept = ((torch.cumsum(srt.clamp(min=0), -1) - srt.clamp(min=0)) < spec.top_p) & (srt >= 0)
    kept_ids = torch.where(kept, alli.gather(-1, o), -1)
    out = torch.zeros_like(probs, dtype=torch.bool)
    local = kept_ids - spec.vocab_start
    ok = (kept_ids >= 0) & (local >= 0) & (local < width)
    r = torch.arange(rows)[:, None].expand_as(local)
    out[r[ok], local[ok]] = True
    return out


def _chunk(z, labels, spec: VocabSpec, stats: bool = True, ws: _Workspace | None = None):
    """(logp of the labels, entropy, q = the filtered renormalized probabilities) of one chunk of
    fp32 logits z [c, real V/TP] (temperature applied). stats=False (backward): q only. With a
    workspace, z is one of its buffers and q another (valid until the next chunk)."""
    rows = len(labels)
    logp_all = _log_softmax(z, spec, None if ws is None else ws.logp[:rows])
    col, mine = _label_mask(labels, spec, z.shape[-1])
    tok = ent = None
    if stats:
        picked = logp_all.gather(-1, col[:, None])[:, 0] if z.shape[-1] else torch.zeros(len(labels))
        tok = _all_reduce(torch.where(mine, picked, 0.0), spec)
        if ws is None:
            probs = logp_all.exp()
            ent = _all_reduce(-torch.linalg.vecdot(probs, logp_all), spec)
        else:  # vecdot is this product summed; z is spent, so the product goes there
            probs = torch.exp(logp_all, out=ws.probs[:rows])
            ent = _all_reduce(-torch.mul(probs, logp_all, out=z).sum(-1), spec)
    else:
        probs = logp_all.exp_()
    keep = _support(probs, spec)
    if keep is None:
        return tok, ent, probs
    rows = torch.arange(len(labels))
    keep[rows[mine], col[mine]] = True  # the sampled token is always in the support
    kept = probs.masked_fill_(~keep, 0.0)
    mass = _all_reduce(kept.sum(-1), spec)
    return (None if tok is None else tok - torch.log(mass)), ent, kept.div_(mass[:, None])


def _rows_per_chunk(w: torch.Tensor, spec: VocabSpec) -> int:
    return max(1, spec.chunk_bytes // (4 * w.shape[0]))


class _ChunkedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, spec: VocabSpec, keep_bytes: int):
        step = _rows_per_chunk(weight, spec)
        width = _width(weight, spec)
        ws = _Workspace(min(step, len(labels)), width, weight.dtype)
        # the backward's first GEMM is this one again (same rows, same shapes: the same bits); kept
        # when the caller allows its memory
        keep = len(labels) * width * weight.element_size() <= keep_bytes
        kept = torch.empty(len(labels), width, dtype=weight.dtype) if keep else None
        tok, ent = [], []
        for i in range(0, len(labels), step):
            lin = None if kept is None else kept[i : i + step]
            z = _chunk_logits(hidden[i : i + step], weight, spec, ws, lin)
            t, e, _ = _chunk(z, labels[i : i + step], spec, ws=ws)
            tok.append(t)
            ent.append(e)
        ctx.save_for_backward(hidden, weight, labels)
        ctx.spec, ctx.kept = spec, kept
        out_ent = torch.cat(ent) if ent else torch.zeros(0)
        ctx.mark_non_differentiable(out_ent)
        return (torch.cat(tok) if tok else hidden.new_zeros(0, dtype=torch.float32)), out_ent

    @staticmethod
    def backward(ctx, grad_tok, _grad_ent):
        hidden, weight, labels = ctx.saved_tensors
        spec, kept = ctx.spec, ctx.kept
        ctx.kept = None  # freed when this backward returns, not with the graph
        step = _rows_per_chunk(weight, spec)
        grad_h = torch.empty_like(hidden)
        width = _width(weight, spec)
        w = weight[:width]
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        ws = _Workspace(min(step, len(labels)), width, weight.dtype)
        # A chunk's weight grad gᵀh is one GEMM in the weight's dtype, as Megatron's output layer computes
        # it (its logits grad arrives in the logits' dtype), summed over chunks in fp32: a bf16 GEMM runs
        # at twice the fp32 one's rate on CPU (0.16 against 0.31 s a 220-row chunk of the real 0.5B's
        # vocab). One buffer, not one a chunk.
        product = torch.empty(width, weight.shape[1], dtype=weight.dtype)
        for i in range(0, len(labels), step):
            h, lab = hidden[i : i + step], labels[i : i + step]
            z = _chunk_logits(h, weight, spec, ws) if kept is None else _scaled(kept[i : i + step], spec, ws)
            g = _chunk(z, lab, spec, stats=False, ws=ws)[2].neg_()
            col, mine = _label_mask(lab, spec, g.shape[-1])
            rows = torch.arange(len(lab))
            g[rows[mine], col[mine]] += 1.0
            g *= grad_tok[i : i + step, None].float() / spec.temperature
            g_low = ws.lin[: len(lab)].copy_(g)  # g in the weight's dtype
            grad_h[i : i + step] = cpu_routes.mm(g_low, w).to(hidden.dtype)
            cpu_routes.mm(g_low.t(), h.to(weight.dtype), out=product)
            _add_into(grad_w[:width], product)
        del ws, product, kept
        return grad_h, grad_w.to(weight.dtype), None, None, None


_ADD_ROWS = 4096  # rows of the fp32 sum converted per block: a few MB, in cache


def _add_into(total: torch.Tensor, part: torch.Tensor) -> None:
    """total (fp32) += part, block by block when part is narrower: torch's in-place add that
    promotes bf16 runs at a sixth of the speed of a convert-then-add through a small fp32 block (0.18
    against 0.03 s for the real 0.5B's [V, H], as fast as an fp32 add)."""
    if part.dtype == total.dtype:
        total += part
        return
    block = torch.empty(min(_ADD_ROWS, len(part)), part.shape[1], dtype=total.dtype)
    for r in range(0, len(part), _ADD_ROWS):
        n = min(_ADD_ROWS, len(part) - r)
        total[r : r + n] += block[:n].copy_(part[r : r + n])


def chunked_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, spec: VocabSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp [R] of each label under the sampling distribution, differentiable in hidden and weight;
    entropy [R] of softmax(z / temperature), no grad). hidden [R, H], weight this rank's [V/TP, H]."""
    # only a pass that will run a backward keeps its logits (under no_grad ctx.needs_input_grad still
    # says True, and a forward-only pass would hold them for nothing)
    grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _ChunkedLogprob.apply(hidden, weight, labels, spec, spec.keep_logits_bytes if grads else 0)


@torch.no_grad()
def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, spec: VocabSpec) -> torch.Tensor:
    """The same logprobs from logits a caller already holds ([R, real V/TP] before temperature)."""
    return _chunk(logits.float() / spec.temperature, labels, spec)[0]
