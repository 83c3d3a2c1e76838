"""Continuous batching: requests join (prefill) and leave (finish) between decode steps.

    waiting groups ──admit (KV pages for prompt + max_new_tokens reserved)──► prefill once per prompt
        ──► n sequences (prompt KV copied) ──► decode steps over every running sequence ──► finished
A group is one prompt with its n samples; their prefill is shared. Reserving the worst case at
admission means a running sequence never runs out of KV pages: under load requests queue, never drop.
"""

from __future__ import annotations

import array
import itertools
import operator
from dataclasses import dataclass, field

import torch

from megatron_trace import faults
from megatron_trace.guidance import GuidanceRecord, split_records
from sglang_backend.api import GenerateRequest, GenerateResult, SamplingParams

from .guidance_log import GuidanceLog, LoggedCapture
from .kv_cache import PagedKVCache
from .model import ForwardBatch, QwenEngineModel
from .sampling import sample_batch


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
    finish_reason: dict | None = None
    guidance_rows: list[int] = field(default_factory=list)  # this sample's rows in the scheduler's GuidanceLog
    guidance_record: GuidanceRecord | None = None  # its guidance record, made when the sample finishes
    guidance_error: str | None = None
    slot_table: torch.Tensor | None = None  # KV slot of each reserved position (pages never change)
    want_routing: bool = False  # return_routed_experts
    routed_rows: list[torch.Tensor] = field(default_factory=list)  # [n, layers, top_k] per forward, in order
    routed_experts: torch.Tensor | None = None  # the finished sample's ids [T, layers, top_k]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output_ids


@dataclass
class Group:
    request: GenerateRequest
    rids: list[str]
    seqs: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        model: QwenEngineModel,
        kv: PagedKVCache,
        *,
        max_running: int,
        context_length: int,
        eos_ids: list[int],
        guided_layers: list[int],
        guidance_mode: str,
        seed: int,
    ):
        self.model, self.kv = model, kv
        self.max_running, self.context_length = max_running, context_length
        self.eos_ids, self.guidance_mode = set(eos_ids), guidance_mode
        self.guided_layers = set(guided_layers)
        self.waiting: list[Group] = []
        self.running: list[Sequence] = []
        self.decode_steps = 0  # decode iterations with requests in flight (a named fault point)
        self.in_flight: list[Sequence] = []  # admitted for this step's prefill: neither waiting nor running
        self.seed_counter = itertools.count(seed * 1_000_003)
        self.log = GuidanceLog(guidance_mode)
        self._table_cache: tuple[list[Sequence], torch.Tensor, list] | None = None

    # -- admission ---------------------------------------------------------------------------
    def reserve_pages(self, req: GenerateRequest) -> int:
        total = len(req.input_ids) + req.sampling_params.max_new_tokens
        return req.sampling_params.n * self.kv.pages_needed(min(total, self.context_length))

    def check(self, request: GenerateRequest) -> None:
        """Refuse a request that could never fit in the KV cache (it would wait forever)."""
        if self.reserve_pages(request) > self.kv.num_pages:
            raise ValueError(
                f"request needs {self.reserve_pages(request)} KV pages (prompt + max_new_tokens, x n) "
                f"but the cache has {self.kv.num_pages}; lower max_new_tokens or n"
            )

    def add(self, group: Group) -> None:
        self.check(group.request)
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
            admitted.append(g)
            total = min(len(g.request.input_ids) + g.request.sampling_params.max_new_tokens, self.context_length)
            g.seqs = [
                Sequence(
                    rid,
                    list(g.request.input_ids),
                    g.request.sampling_params,
                    self._generator(g.request.sampling_params, i),
                    [],
                    g.request.return_guidance,
                )
                for i, rid in enumerate(g.rids)
            ]
            self.in_flight += g.seqs  # from here on a failure still answers every rid of the group
            for s in g.seqs:
                s.want_routing = g.request.return_routed_experts
                s.pages = self.kv.allocate(self.kv.pages_needed(total))
                s.slot_table = self.kv.slots(s.pages, 0, len(s.pages) * self.kv.page_size)
        return admitted

    # -- one iteration -----------------------------------------------------------------------
    @torch.inference_mode()  # every tensor a step makes (KV, guidance rows) lives in inference mode
    def step(self) -> list[Sequence]:
        """Prefill newly admitted groups, or decode every running sequence; returns finished ones."""
        self.in_flight = []
        admitted = self._admit()
        if admitted:
            finished = self._prefill(admitted)
        elif self.running:
            self.decode_steps += 1
            faults.hit("engine.decode_step", n=self.decode_steps)
            finished = self._decode()
        else:
            return []
        self.in_flight = []
        for s in finished:
            if s.want_routing and s.finish_reason.get("type") != "abort":
                s.routed_experts = _routed_experts(s)
        wanted = [s for s in finished if s.want_guidance and s.finish_reason.get("type") != "abort"]
        if wanted:
            try:
                sites, lens = self.log.gather(wanted, [s for s in self.running if s.want_guidance])
                records = split_records([s.rid for s in wanted], self.guidance_mode, lens, sites)
                for s, n, r in zip(wanted, lens, records):
                    if n == len(s.tokens) - 1:
                        s.guidance_record = r
                    else:  # fails this record only
                        s.guidance_error = f"guidance covers {n} of sample {s.rid}'s {len(s.tokens) - 1} positions"
            except Exception as e:  # fails these records only (their requests abort), not the batch
                for s in wanted:
                    s.guidance_error = f"guidance capture failed: {e}"
                self.log = GuidanceLog(self.guidance_mode)
                for s in self.running:
                    s.guidance_rows = []
                    if s.want_guidance:
                        s.guidance_error = f"guidance capture failed: {e}"
        return finished

    def _capture(self, seqs_rows: list[tuple[list[Sequence], int, int]], num_rows: int):
        """capture fn and a commit fn that logs the step's sites and each sample's rows."""
        if not any(s.want_guidance for seqs, _, _ in seqs_rows for s in seqs):
            return None, None
        first = self.log.reserve(num_rows)
        capture = LoggedCapture(self.log, first, self.guided_layers)

        def commit() -> None:
            for seqs, a, b in seqs_rows:
                if b - a == 1:  # a decode row
                    for s in seqs:
                        if s.want_guidance:
                            s.guidance_rows.append(first + a)
                    continue
                for s in seqs:
                    if s.want_guidance:
                        s.guidance_rows.extend(range(first + a, first + b))

        return capture, commit

    def _prefill(self, groups: list[Group]) -> list[Sequence]:
        ids, pos, spans, write, read, off = [], [], [], [], [], 0
        for g in groups:
            lead, p = g.seqs[0], len(g.request.input_ids)
            ids += lead.prompt
            pos += range(p)
            spans.append((off, off + p))
            slots = lead.slot_table[:p]
            write.append(slots)
            read.append(slots)
            off += p
        batch = ForwardBatch(torch.tensor(ids), torch.tensor(pos), spans, torch.cat(write), read)
        batch.routed_experts = self._routing_buffer([s for g in groups for s in g.seqs], off)
        capture, commit = self._capture([(g.seqs, a, b) for g, (a, b) in zip(groups, spans)], off)
        logits = self.model(batch, self.kv, capture)
        if commit:
            commit()
        if batch.routed_experts is not None:
            for g, (a, b) in zip(groups, spans):
                for s in g.seqs:
                    if s.want_routing:
                        s.routed_rows.append(batch.routed_experts[a:b])
        for g, slots in zip(groups, read):
            for s in g.seqs[1:]:  # shared prefill: the other samples copy the prompt's KV
                self.kv.copy_slots(slots, s.slot_table[: len(s.prompt)])
        seqs = [s for g in groups for s in g.seqs]
        rows = torch.tensor([i for i, g in enumerate(groups) for _ in g.seqs])
        return self._append_all(seqs, logits.index_select(0, rows))

    def _decode(self) -> list[Sequence]:
        seqs = self.running
        pos = [len(s.prompt) + len(s.output_ids) - 1 for s in seqs]
        cached = self._table_cache
        if cached is None or len(cached[0]) != len(seqs) or not all(map(operator.is_, cached[0], seqs)):
            # the batch changed: re-pad its slot tables (kept while the same sequences decode)
            self._table_cache = (
                list(seqs),
                torch.nn.utils.rnn.pad_sequence([s.slot_table for s in seqs], batch_first=True),
                [(i, i + 1) for i in range(len(seqs))],
            )
        _, table, spans = self._table_cache
        pos_t = long_tensor(pos)
        write = table.gather(1, pos_t[:, None])[:, 0]
        batch = ForwardBatch(
            long_tensor([s.output_ids[-1] for s in seqs]),
            pos_t,
            spans,
            write,
            [],
            read_index=table,
            read_lens=pos_t + 1,
            decode=True,
        )
        batch.routed_experts = self._routing_buffer(seqs, len(seqs))
        capture = commit = None
        if any(s.want_guidance for s in seqs):
            capture, commit = self._capture([([s], i, i + 1) for i, s in enumerate(seqs)], len(seqs))
        logits = self.model(batch, self.kv, capture)
        if commit:
            commit()
        if batch.routed_experts is not None:
            for i, s in enumerate(seqs):
                if s.want_routing:
                    s.routed_rows.append(batch.routed_experts[i : i + 1])
        return self._append_all(seqs, logits)

    def _routing_buffer(self, seqs: list[Sequence], num_rows: int) -> torch.Tensor | None:
        """Where this forward's MoE layers write their top-k ids, if any sample asked for them."""
        if not any(s.want_routing for s in seqs):
            return None
        a = self.model.arch
        return torch.zeros(num_rows, a.num_layers, a.num_experts_per_tok, dtype=torch.int32)

    def _append_all(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Sequence]:
        """Sample one token for each sequence (row i of logits); the survivors form the next batch."""
        toks, lps = sample_batch(logits, [s.params for s in seqs], [s.gen for s in seqs])
        running = [] if seqs is self.running else list(self.running)  # prefill: new samples join
        finished, eos, ctx = [], self.eos_ids, self.context_length
        for s, tok, lp in zip(seqs, toks, lps):
            out = s.output_ids
            out.append(tok)
            s.logprobs.append(lp)
            p = s.params
            if (p.stop_token_ids and tok in p.stop_token_ids) or (not p.ignore_eos and tok in eos):
                s.finish_reason = {"type": "stop", "matched": tok}
            elif len(out) >= p.max_new_tokens or len(s.prompt) + len(out) >= ctx:
                s.finish_reason = {"type": "length", "length": len(out)}
            else:
                running.append(s)
                continue
            finished.append(s)
        for s in finished:
            self.kv.release(s.pages)
            s.pages = []
        self.running = running
        return finished

    def abort_all(self, message: str) -> list[Sequence]:
        """Fail every admitted sequence: running, waiting and those caught mid-prefill."""
        out, seen = [], set()
        for s in self.running + self.in_flight + [s for g in self.waiting for s in g.seqs]:
            if id(s) in seen:
                continue
            seen.add(id(s))
            s.finish_reason = {"type": "abort", "message": message}
            self.kv.release(s.pages)
            s.pages = []
            out.append(s)
        self.running, self.waiting, self.in_flight = [], [], []
        self.log = GuidanceLog(self.guidance_mode)
        self._table_cache = None
        return out


def guidance_record(s: Sequence) -> GuidanceRecord:
    """A finished sample's guidance record, or the capture failure as an error."""
    if s.guidance_error or s.guidance_record is None:
        raise RuntimeError(s.guidance_error or f"sample {s.rid} has no guidance record")
    return s.guidance_record


def long_tensor(values: list[int]) -> torch.Tensor:
    """int64 tensor of a list of Python ints: ~2 us where torch.tensor takes ~10 (a step makes several)."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def _routed_experts(s: Sequence) -> torch.Tensor:
    """A finished sample's routed expert ids [T, layers, top_k] over its T = prompt + output - 1 positions."""
    ids = torch.cat(s.routed_rows)
    s.routed_rows = []
    if ids.shape[0] != len(s.tokens) - 1:
        raise RuntimeError(f"routed experts cover {ids.shape[0]} of sample {s.rid}'s {len(s.tokens) - 1} positions")
    return ids


def to_result(s: Sequence, version: str, guidance_handle: str | None) -> GenerateResult:
    return GenerateResult(
        s.rid, s.output_ids, s.logprobs, s.finish_reason, len(s.prompt), version, guidance_handle, s.routed_experts
    )


def aborted_result(rid: str, prompt_tokens: int, version: str, message: str) -> GenerateResult:
    """A request's result when it was aborted (engine error, shutdown): no tokens, the reason."""
    return GenerateResult(rid, [], [], {"type": "abort", "message": message}, prompt_tokens, version)
