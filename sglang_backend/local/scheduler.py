"""Continuous batching: requests join (prefill) and leave (finish) between decode steps.

    waiting groups ──admit (KV pages for prompt + max_new_tokens reserved)──► prefill once per prompt
        ──► n sequences (prompt KV copied) ──► decode steps over every running sequence ──► finished
A group is one prompt with its n samples; their prefill is shared. Reserving the worst case at
admission means a running sequence never runs out of KV pages: under load requests queue, never drop.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from megatron_trace.guidance import GuidanceRecord, SiteRecord, concat_sites, make_site

from sglang_backend.api import GenerateRequest, GenerateResult, SamplingParams

from .kv_cache import PagedKVCache
from .model import ForwardBatch, QwenEngineModel
from .sampling import sample_token


@dataclass
class Sequence:
    rid: str
    prompt: list[int]
    params: SamplingParams
    gen: torch.Generator
    pages: list[int]
    want_guidance: bool
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    guidance_parts: dict[str, list[SiteRecord]] = field(default_factory=dict)
    finish_reason: dict | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output_ids


@dataclass
class Group:
    request: GenerateRequest
    rids: list[str]
    seqs: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, model: QwenEngineModel, kv: PagedKVCache, *, max_running: int, context_length: int,
                 eos_ids: list[int], guided_layers: list[int], guidance_mode: str, seed: int):
        self.model, self.kv = model, kv
        self.max_running, self.context_length = max_running, context_length
        self.eos_ids, self.guidance_mode = set(eos_ids), guidance_mode
        self.guided_layers = set(guided_layers)
        self.waiting: list[Group] = []
        self.running: list[Sequence] = []
        self.seed_counter = itertools.count(seed * 1_000_003)

    # -- admission ---------------------------------------------------------------------------
    def reserve_pages(self, req: GenerateRequest) -> int:
        total = len(req.input_ids) + req.sampling_params.max_new_tokens
        return req.sampling_params.n * self.kv.pages_needed(min(total, self.context_length))

    def add(self, group: Group) -> None:
        if self.reserve_pages(group.request) > self.kv.num_pages:
            raise ValueError(
                f"request needs {self.reserve_pages(group.request)} KV pages (prompt + max_new_tokens, x n) "
                f"but the cache has {self.kv.num_pages}; lower max_new_tokens or n"
            )
        self.waiting.append(group)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _generator(self, params: SamplingParams, i: int) -> torch.Generator:
        seed = params.sampling_seed + i if params.sampling_seed is not None else next(self.seed_counter)
        return torch.Generator().manual_seed(seed)

    def _admit(self) -> list[Group]:
        admitted = []
        while self.waiting:
            g = self.waiting[0]
            n = g.request.sampling_params.n
            if len(self.running) + sum(len(a.rids) for a in admitted) + n > self.max_running:
                break
            if self.reserve_pages(g.request) > len(self.kv.free_pages):
                break
            self.waiting.pop(0)
            total = min(len(g.request.input_ids) + g.request.sampling_params.max_new_tokens, self.context_length)
            for i, rid in enumerate(g.rids):
                pages = self.kv.allocate(self.kv.pages_needed(total))
                g.seqs.append(Sequence(rid, list(g.request.input_ids), g.request.sampling_params,
                                       self._generator(g.request.sampling_params, i), pages, g.request.return_guidance))
            admitted.append(g)
        return admitted

    # -- one iteration -----------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Prefill newly admitted groups, or decode every running sequence; returns finished ones."""
        admitted = self._admit()
        if admitted:
            return self._prefill(admitted)
        if self.running:
            return self._decode()
        return []

    def _capture(self, seqs_spans: list[tuple[list[Sequence], int, int]]):
        if not any(s.want_guidance for seqs, _, _ in seqs_spans for s in seqs):
            return None, None
        store: dict[str, object] = {}

        def capture(site: str, q) -> None:
            if int(site.split(".")[2]) in self.guided_layers:
                store[site] = q

        def distribute() -> None:
            for seqs, a, b in seqs_spans:
                for site, q in store.items():
                    gs = q.global_scale if q.global_scale.dim() == 0 else q.global_scale[a:b]
                    rec = make_site(q.scale[a:b], gs, q.data[a:b], self.guidance_mode)
                    for s in seqs:
                        if s.want_guidance:
                            s.guidance_parts.setdefault(site, []).append(rec)

        return capture, distribute

    def _prefill(self, groups: list[Group]) -> list[Sequence]:
        ids, pos, spans, write, read, off = [], [], [], [], [], 0
        for g in groups:
            lead, p = g.seqs[0], len(g.request.input_ids)
            ids += lead.prompt
            pos += range(p)
            spans.append((off, off + p))
            slots = self.kv.slots(lead.pages, 0, p)
            write.append(slots)
            read.append(slots)
            off += p
        batch = ForwardBatch(torch.tensor(ids), torch.tensor(pos), spans, torch.cat(write), read)
        capture, distribute = self._capture([(g.seqs, a, b) for g, (a, b) in zip(groups, spans)])
        logits = self.model(batch, self.kv, capture)
        if distribute:
            distribute()
        finished = []
        for g, row, slots in zip(groups, logits, read):
            for s in g.seqs[1:]:  # shared prefill: the other samples copy the prompt's KV
                self.kv.copy_slots(slots, self.kv.slots(s.pages, 0, len(s.prompt)))
            for s in g.seqs:
                finished += self._append(s, row)
        return finished

    def _decode(self) -> list[Sequence]:
        seqs = self.running
        pos = [len(s.tokens) - 1 for s in seqs]
        write = torch.cat([self.kv.slots(s.pages, p, p + 1) for s, p in zip(seqs, pos)])
        read = [self.kv.slots(s.pages, 0, p + 1) for s, p in zip(seqs, pos)]
        batch = ForwardBatch(torch.tensor([s.tokens[-1] for s in seqs]), torch.tensor(pos),
                             [(i, i + 1) for i in range(len(seqs))], write, read)
        capture, distribute = self._capture([([s], i, i + 1) for i, s in enumerate(seqs)])
        logits = self.model(batch, self.kv, capture)
        if distribute:
            distribute()
        self.running = []
        finished = []
        for s, row in zip(seqs, logits):
            finished += self._append(s, row)
        return finished

    def _append(self, s: Sequence, logits: torch.Tensor) -> list[Sequence]:
        tok, lp = sample_token(logits, s.params, s.gen)
        s.output_ids.append(tok)
        s.logprobs.append(lp)
        p = s.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            s.finish_reason = {"type": "stop", "matched": tok}
        elif len(s.output_ids) >= p.max_new_tokens or len(s.tokens) >= self.context_length:
            s.finish_reason = {"type": "length", "length": len(s.output_ids)}
        if s.finish_reason is None:
            self.running.append(s)
            return []
        self.kv.release(s.pages)
        s.pages = []
        return [s]

    def abort_all(self, message: str) -> list[Sequence]:
        out = []
        for s in self.running + [s for g in self.waiting for s in g.seqs]:
            s.finish_reason = {"type": "abort", "message": message}
            self.kv.release(s.pages)
            s.pages = []
            out.append(s)
        self.running, self.waiting = [], []
        return out


def guidance_record(s: Sequence, mode: str) -> GuidanceRecord:
    sites = {name: concat_sites(parts) for name, parts in s.guidance_parts.items()}
    rec = GuidanceRecord(s.rid, mode, len(s.tokens) - 1, sites)
    rec.validate()
    return rec


def to_result(s: Sequence, version: int, guidance_handle: str | None) -> GenerateResult:
    return GenerateResult(s.rid, s.output_ids, s.logprobs, s.finish_reason, len(s.prompt), version, guidance_handle)
