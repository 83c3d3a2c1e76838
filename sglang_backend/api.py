"""The rollout contract: what the trainer side may ask of any rollout backend.

    trainer/loop ──generate(requests)──► backend ──► results (tokens, logprobs, version, guidance handle,
                                                            routed experts as a tensor)
                 ──fetch_guidance(handle)──► GuidanceRecord
                 ──update_weights(bucket, version)──► pause → load → flush KV → resume
Implementations: the embedded engine in-process (`sglang_backend.local.InProcessBackend`: records,
routed experts and weights pass as objects and tensors), and the HTTP client
(`sglang_backend.client.RolloutClient`) that speaks SGLang's native endpoints to our embedded server
or a real SGLang server with our plugin, turning the wire forms (base64 ids, record bytes) into the
same objects as they arrive. Field names follow SGLang's JSON so the two map one to one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from megatron_trace.guidance.routing import encode_routed_experts, wire_routed_experts

if TYPE_CHECKING:
    from megatron_trace.guidance import GuidanceRecord

_SAMPLING_ALIASES = {"stop_token_ids": list}
GUIDANCE_KEY = "trace_return_guidance"  # sampling_params.custom_params key that asks for a guidance record
DEFAULT_VERSION = "default"  # SGLang's weight_version when the server was started without --weight-version
# GET: what a server stores and records, as TRACE needs it (the embedded server and the SGLang plugin):
# {"kv_formats": [K, V], "kv_k_debias": bool, "guided_layers": [int], "guidance_mode": str}
TRACE_POLICY_PATH = "/trace_policy"


def trace_policy_of(kv_formats, kv_k_debias: bool, guided_layers, guidance_mode: str) -> dict[str, Any]:
    """The TRACE_POLICY_PATH answer; kv_k_debias holds only where K is quantized (a BF16 K has no bias to take out)."""
    kv_formats = [str(f) for f in kv_formats]
    return {
        "kv_formats": kv_formats,
        "kv_k_debias": bool(kv_k_debias) and kv_formats[0] != "bf16",
        "guided_layers": [int(i) for i in guided_layers or ()],
        "guidance_mode": str(guidance_mode),
    }


def version_step(v: str | int) -> int:
    """The trainer's version number of a served weight version: "7" -> 7. SGLang's launch default
    "default" names the checkpoint the server started from, which is the trainer's version 0."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if v == DEFAULT_VERSION:
        return 0
    if isinstance(v, str) and v.isdigit():
        return int(v)
    raise ValueError(f"weight version {v!r} is not one the trainer set (a decimal step number or {DEFAULT_VERSION!r})")


def wire_version(step: int | str) -> str:
    """What a server is told and reports for the trainer's version `step` (SGLang's weight_version is a
    string): 7 -> "7". Versions are the trainer's step numbers everywhere; this and `version_step` are
    the only conversions to and from the wire."""
    return str(version_step(step))


def serves_version(served, step: int | str) -> bool:
    """Whether a server's reported weight_version is the trainer's version `step` (a version the
    trainer never set, e.g. another run's name, is not)."""
    try:
        return version_step(served) == version_step(step)
    except ValueError:
        return False


@dataclass
class SamplingParams:
    """SGLang's sampling_params subset we honour; unknown keys are rejected, as SGLang does."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: all tokens
    min_p: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    sampling_seed: int | None = None

    def __post_init__(self) -> None:
        def bad(key, allowed):
            raise ValueError(f"sampling_params.{key} must be {allowed}; got {getattr(self, key)!r}")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            bad("max_new_tokens", "an int >= 0")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad("temperature", "a number >= 0 (0 = greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            bad("top_k", "-1 (all) or an int >= 1")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "an int >= 1")
        if self.sampling_seed is not None and not isinstance(self.sampling_seed, int):
            bad("sampling_seed", "an int or null")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            isinstance(t, int) for t in self.stop_token_ids
        ):
            bad("stop_token_ids", "a list of ints")
        self.stop_token_ids = list(self.stop_token_ids)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        d = dict(d or {})
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - allowed)
        if unknown:
            hint = " (SGLang names the seed 'sampling_seed')" if "seed" in unknown else ""
            raise ValueError(f"unknown sampling_params keys {unknown}{hint}; allowed: {sorted(allowed)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GenerateRequest:
    input_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    rid: str | None = None
    return_logprob: bool = True
    return_guidance: bool = False
    return_routed_experts: bool = False  # SGLang's top-level key: the router's top-k ids per position and layer


@dataclass
class GenerateResult:
    rid: str
    output_ids: list[int]
    output_logprobs: list[float]  # float32 logprob of each sampled token under the rollout's numerics
    finish_reason: dict[str, Any]
    prompt_tokens: int
    weight_version: str  # as the server names it (SGLang: any string, "default" unless set)
    guidance_handle: str | None = None
    # the router's int32 ids [prompt + output - 1, layers, top_k] (from a server: flat, as decoded from
    # SGLang's base64 meta_info["routed_experts"]; megatron_trace.guidance.decode_routed_experts shapes it)
    routed_experts: torch.Tensor | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    def to_sglang(self, logprobs: bool = True) -> dict[str, Any]:
        """SGLang's /generate response shape for one request (without output_token_logprobs when the
        request did not ask for them, as SGLang answers)."""
        meta = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": 0,
            "weight_version": str(self.weight_version),
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(self.output_logprobs, self.output_ids)],
        }
        if not logprobs:
            del meta["output_token_logprobs"]
        if self.guidance_handle is not None:
            meta["guidance_handle"] = self.guidance_handle
        if self.routed_experts is not None:
            meta["routed_experts"] = encode_routed_experts(self.routed_experts)
        return {"output_ids": list(self.output_ids), "meta_info": meta}

    @classmethod
    def from_sglang(cls, d: dict[str, Any]) -> GenerateResult:
        meta = d["meta_info"]
        logprobs = [float(t[0]) for t in meta.get("output_token_logprobs") or []]
        # Under top-k/top-p, SGLang's "selected" sampling logprobs (return_sampling_mask) are those of
        # the filtered distribution the tokens were drawn from; the embedded engine reports those in
        # output_token_logprobs already (sglang_backend/api.py: sampling support).
        filtered = meta.get("output_token_sampling_logprobs")
        if filtered is not None and len(filtered) == len(d["output_ids"]):
            logprobs = [float(x) for x in filtered]
        return cls(
            rid=meta["id"],
            output_ids=list(d["output_ids"]),
            output_logprobs=logprobs,
            finish_reason=meta.get("finish_reason") or {},
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            weight_version=str(meta.get("weight_version", DEFAULT_VERSION)),
            guidance_handle=meta.get("guidance_handle"),
            routed_experts=None if meta.get("routed_experts") is None else wire_routed_experts(meta["routed_experts"]),
        )


class RolloutAborted(RuntimeError):
    """A rollout backend aborted a request (an engine error, a shutdown): its result holds no answer,
    and scoring it as one (an empty answer, reward 0) would hide the failure. Carries the backend's
    own message."""


def _finish_of(result) -> tuple[str, dict]:
    """(rid, finish_reason) of a GenerateResult or of SGLang's /generate answer for one request."""
    if isinstance(result, GenerateResult):
        return result.rid, result.finish_reason or {}
    meta = result.get("meta_info") or {}
    return str(meta.get("id")), meta.get("finish_reason") or {}


def check_answered(results: list, what: str) -> list:
    """`results` (GenerateResults or SGLang's /generate answers) when no request was aborted; else
    RolloutAborted naming `what` (which batch), the first aborted request and the backend's message."""
    aborted = [(rid, fr) for rid, fr in map(_finish_of, results) if fr.get("type") == "abort"]
    if aborted:
        rid, fr = aborted[0]
        raise RolloutAborted(
            f"{what}: the rollout backend aborted {len(aborted)} of {len(results)} requests (first: {rid}: "
            f"{fr.get('message', fr)}); an aborted request has no answer to score, so this stops here"
        )
    return results


@dataclass
class WeightBucket:
    """An ordered list of HF-named tensors; FP4 linears in the ModelOpt NVFP4 layout."""

    tensors: dict[str, torch.Tensor]
    version: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def to_bytes(self) -> bytes:
        """safetensors bytes; the header's metadata carries the version and the tensor order."""
        meta = {"version": str(self.version), "order": json.dumps(list(self.tensors))}
        return st_save({k: v.contiguous() for k, v in self.tensors.items()}, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes) -> WeightBucket:
        if len(data) < 8:
            raise ValueError("weight bucket is truncated: no safetensors header")
        n = int.from_bytes(data[:8], "little")
        if n > len(data) - 8:
            raise ValueError("weight bucket is truncated: header runs past the end")
        try:
            meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
            tensors = st_load(data)
        except Exception as e:  # safetensors raises its own error types for corrupt bodies
            raise ValueError(f"weight bucket is corrupt: {e}") from None
        order = json.loads(meta.get("order", "[]")) or list(tensors)
        if sorted(order) != sorted(tensors):
            raise ValueError("weight bucket header's tensor order does not match its tensors")
        return cls({k: tensors[k] for k in order}, int(meta.get("version", 0)))


class RolloutBackend(Protocol):
    """Every rollout backend: the embedded engine in-process, or a client of HTTP servers."""

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]: ...

    def update_weights(self, bucket: WeightBucket, *, flush_cache: bool = True) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def flush_cache(self) -> None: ...

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free the KV pool and/or the weights (SGLang's tags `kv_cache`, `weights`; none: both) while a
        colocated trainer trains; refused while requests run. Generation waits for the resume and, for
        weights, for an update that refills them."""

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None: ...

    def health(self) -> bool: ...

    def model_info(self) -> dict[str, Any]: ...

    def fetch_guidance(self, handle: str) -> GuidanceRecord: ...

    def note_version(self, version: int) -> None:
        """The rollout now serves `version`, pushed past the backend (a transport of its own)."""

    def close(self) -> None:
        """Release what the backend holds (the engine, probe threads, connections)."""


# -- sampling support: which tokens a request's top-k / top-p / min-p keep, and a token's logprob --------
#
#     logits / T ─► log_softmax ─► probs ─► keep = top-k ∩ top-p ∩ min-p ─► sample from probs·keep
#                                                                       └► logprob = log(p_tok / Σ_keep p)
# The logprob a rollout records is the one of the distribution it actually sampled from (the
# renormalized, filtered one); the trainer's recompute calls the same functions on its own logits, so
# with identical numerics the importance ratio is exactly 1 under top-p too. (SGLang reports the
# unfiltered softmax unless a request sets `return_sampling_mask`, whose "selected" logprob is this
# one.) Part of the contract: both sides must compute it alike.


def needs_filter(top_k: int, top_p: float, min_p: float, vocab: int) -> bool:
    return (top_k != -1 and top_k < vocab) or top_p < 1.0 or min_p > 0


def keep_mask(probs: torch.Tensor, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """probs [R, V] -> bool [R, V]: the tokens sampling may pick (top-k, then nucleus, then min-p).

    Nucleus: a token is kept while the mass strictly above it is < top_p, so the most likely
    token always survives. Ties are ordered by a stable sort, the same on both sides."""
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k != -1 and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k, dim=-1).values[..., -1:]
        keep &= probs >= kth
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sorted_p, -1) - sorted_p
        keep &= torch.zeros_like(keep).scatter(-1, order, before < top_p)
    if min_p > 0:
        keep &= probs >= min_p * probs.amax(-1, keepdim=True)
    return keep


def support_logprob(logp: torch.Tensor, tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """log p(token) under the filtered, renormalized distribution: logp[tok] - log Σ_keep exp(logp).

    logp [R, V] (log_softmax at the sampling temperature), tokens [R], keep [R, V]. The sampled
    token is always counted in the support (a trainer whose own nucleus, computed from slightly
    different logits, misses it still gets a finite logprob). Differentiable in logp."""
    keep = keep.scatter(-1, tokens[:, None], True)
    mass = torch.where(keep, logp.exp(), torch.zeros((), dtype=logp.dtype)).sum(-1)
    return logp.gather(-1, tokens[:, None])[:, 0] - torch.log(mass)
