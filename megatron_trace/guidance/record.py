"""The TRACE guidance record: what the rollout's FP4 rounding was, per sample, site and position.

One record per sample. Sites are named after the quantized input they describe:
    model.layers.{i}.self_attn.qkv_proj   input of the fused q/k/v GEMM        [T, hidden]
    model.layers.{i}.self_attn.o_proj     input of o_proj                      [T, q_size]
    model.layers.{i}.mlp.gate_up_proj     input of the fused gate/up GEMM      [T, hidden]
    model.layers.{i}.mlp.down_proj        input of down_proj                   [T, intermediate]
    model.layers.{i}.mlp.experts.gate_up_proj / down_proj   per routed slot    [T, top_k, K]
    model.layers.{i}.self_attn.k_cache / v_cache             K, V as cached    [T, kv_heads, head_dim]
T counts every position the rollout ran through the model: the prompt and all sampled tokens
but the last (whose activations nobody computes). Each site holds the E4M3 block-scale bytes
[..., K/16], the global scale S_enc (one per token, or 0-d for a static scale) and either the
packed 4-bit codes [..., K/2] (mode "full") or packed mantissa bits [..., K/8] ("mantissa").
An FP8 K/V site (fp4.fp8: one S_enc per token over its heads, no block scales) holds zero-width
block scales [T, heads, 0], S_enc [T] and its E4M3 bytes [T, heads, D] or their lowest bits
[T, heads, D/8]: the zero width is what marks it (`SiteRecord.fp8`).
Records serialize to safetensors bytes with a JSON header: no pickle crosses a process boundary.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from megatron_trace.fp4 import FP8Tensor, MXFP4Tensor, NVFP4Tensor, RolloutRounding
from megatron_trace.fp4.guided import GUIDANCE_MODES, mantissa_bits

# the dispatcher's: C on CPU (the engine packs every guided row of finished samples)
from megatron_trace.kernels.dispatch import mantissa_bits_packed

KV_SITES = ("k_cache", "v_cache")
_STATIC_ONE = torch.tensor(1.0)  # the S_enc an MXFP4 site carries: E8M0 block scales, no global scale


@dataclass
class SiteRecord:
    scale: torch.Tensor  # uint8 [T, ..., K/16]
    global_scale: torch.Tensor  # fp32 [T, ...] per token, or 0-d when static
    payload: torch.Tensor  # uint8 codes [T, ..., K/2] or mantissa bits [T, ..., K/8]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.scale, self.global_scale, self.payload))

    def positions(self) -> int:
        return self.scale.shape[0]

    @property
    def fp8(self) -> bool:
        """An FP8 site: E4M3 bytes with one S_enc per token, no block scales."""
        return self.scale.shape[-1] == 0

    def select(self, start: int, end: int) -> SiteRecord:
        gs = self.global_scale if self.global_scale.dim() == 0 else self.global_scale[start:end]
        return SiteRecord(self.scale[start:end], gs, self.payload[start:end])


def quantized_parts(q: NVFP4Tensor | MXFP4Tensor | FP8Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block scales, S_enc, codes) of a quantizer's output, as a site records them (`make_site`'s
    arguments): MXFP4 with a static S_enc of 1.0, FP8 with zero-width block scales and its per-row S_enc."""
    if isinstance(q, FP8Tensor):
        if q.encode is None:
            raise ValueError("an FP8 tensor without its S_enc (FP8Tensor.encode) cannot be recorded as guidance")
        return q.data.new_empty(*q.data.shape[:-1], 0), q.encode, q.data
    return q.scale, (_STATIC_ONE if isinstance(q, MXFP4Tensor) else q.global_scale), q.data


def make_site(scale, global_scale, codes, mode: str) -> SiteRecord:
    """Build a site from a quantizer's output (`quantized_parts`: packed FP4 codes, or FP8 bytes with
    zero-width block scales), keeping what `mode` asks for."""
    if mode not in GUIDANCE_MODES:
        raise ValueError(f"guidance.mode must be one of {', '.join(GUIDANCE_MODES)}; got {mode!r}")
    payload = codes if mode == "full" else _mantissa(codes, fp8=scale.shape[-1] == 0)
    return SiteRecord(scale.contiguous(), global_scale.to(torch.float32).contiguous(), payload.contiguous())


def _mantissa(codes: torch.Tensor, fp8: bool) -> torch.Tensor:
    """Each element's lowest code bit, 8 per byte: of FP8 bytes, or of packed FP4 codes."""
    return mantissa_bits(codes) if fp8 else mantissa_bits_packed(codes)


def concat_sites(parts: list[SiteRecord]) -> SiteRecord:
    """Join records of consecutive positions (prefill, then each decode step)."""
    gs = parts[0].global_scale
    if gs.dim() == 0:
        global_scale = gs
    else:
        global_scale = torch.cat([p.global_scale for p in parts])
    return SiteRecord(torch.cat([p.scale for p in parts]), global_scale, torch.cat([p.payload for p in parts]))


@dataclass
class GuidanceRecord:
    sample_id: str
    mode: str
    num_positions: int
    sites: dict[str, SiteRecord] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in GUIDANCE_MODES:
            raise ValueError(f"guidance.mode must be one of {', '.join(GUIDANCE_MODES)}; got {self.mode!r}")

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.sites.values())

    def bytes_per_token(self) -> float:
        return self.nbytes() / max(self.num_positions, 1)

    def validate(self, num_positions: int | None = None) -> None:
        """Every site covers the same positions (and `num_positions` when given)."""
        want = self.num_positions if num_positions is None else num_positions
        for name, site in self.sites.items():
            if site.positions() != want:
                raise ValueError(
                    f"guidance record {self.sample_id!r} site {name} covers {site.positions()} positions; "
                    f"the sample needs {want}"
                )

    def rounding(self, site: str, start: int = 0, end: int | None = None) -> RolloutRounding:
        """What fp4.guided_quantize needs for positions [start, end) of one site."""
        if site not in self.sites:
            raise KeyError(f"guidance record {self.sample_id!r} has no site {site!r}")
        s = self.sites[site].select(start, self.num_positions if end is None else end)
        if self.mode == "full":
            return RolloutRounding(s.scale, s.global_scale, codes=s.payload)
        return RolloutRounding(s.scale, s.global_scale, mantissa=s.payload)

    def to_mantissa(self) -> GuidanceRecord:
        """The compact record a mantissa-mode rollout would have written (from full codes)."""
        if self.mode == "mantissa":
            return self
        sites = {n: SiteRecord(s.scale, s.global_scale, _mantissa(s.payload, s.fp8)) for n, s in self.sites.items()}
        return GuidanceRecord(self.sample_id, "mantissa", self.num_positions, sites)

    def to_bytes(self) -> bytes:
        """safetensors bytes (any safetensors reader loads them), written directly: a record is
        dozens of tiny tensors, for which safetensors.torch.save's per-tensor overhead dominates.
        float32 tensors come first (safetensors orders by alignment), so readers can view each
        tensor in place. Every site must cover `num_positions`."""
        return encode_records([self.sample_id], self.mode, [self.num_positions], self.sites)[0]

    @classmethod
    def from_bytes(cls, data: bytes) -> GuidanceRecord:
        header = _header(data)
        meta = _checked_meta(header.pop("__metadata__", {}))
        base = 8 + int.from_bytes(data[:8], "little")
        buf = np.frombuffer(bytearray(memoryview(data)[base:]), dtype=np.uint8)  # one copy; tensors view it
        tensors = {name: _tensor(name, info, buf) for name, info in header.items()}
        sites = {}
        for name in json.loads(meta["sites"]):
            try:
                sites[name] = SiteRecord(*(tensors[f"{name}/{k}"] for k in ("scale", "global_scale", "payload")))
            except KeyError as e:
                raise ValueError(f"guidance record bytes are missing tensor {e.args[0]}") from None
        return cls(meta["sample_id"], meta["mode"], int(meta["num_positions"]), sites)


def split_records(
    sample_ids: list[str], mode: str, lens: list[int], sites: dict[str, SiteRecord]
) -> list[GuidanceRecord]:
    """Each sample's record, from sites that hold all samples' positions one after another (lens[i]
    rows each; a 0-d global scale is shared): views of the batch's tensors, nothing copied. What an
    in-process rollout hands the trainer; `encode_records` is the same split as bytes, for a wire."""
    if len(sample_ids) != len(lens):
        raise ValueError(f"{len(sample_ids)} sample ids but {len(lens)} position counts")
    out, start = [], 0
    for sid, n in zip(sample_ids, lens):
        out.append(GuidanceRecord(sid, mode, n, {name: site.select(start, start + n) for name, site in sites.items()}))
        start += n
    return out


def encode_records(sample_ids: list[str], mode: str, lens: list[int], sites: dict[str, SiteRecord]) -> list[bytes]:
    """Each sample's `GuidanceRecord.to_bytes()`, from sites that hold all samples' positions one
    after another (lens[i] rows each; a 0-d global scale is shared). Each tensor is converted and
    described once per batch; per sample only offsets and slices remain (the engine's hot path)."""
    if mode not in GUIDANCE_MODES:
        raise ValueError(f"guidance.mode must be one of {', '.join(GUIDANCE_MODES)}; got {mode!r}")
    if len(sample_ids) != len(lens):
        raise ValueError(f"{len(sample_ids)} sample ids but {len(lens)} position counts")
    total = sum(lens)
    columns = [_column(f"{n}/global_scale", site.global_scale, total) for n, site in sites.items()]
    columns += [
        _column(f"{n}/{k}", t, total)
        for n, site in sites.items()
        for k, t in (("scale", site.scale), ("payload", site.payload))
    ]
    # The header differs between samples only in the position count n: tensor j spans bytes
    # [n * per_row[j] + fixed[j], n * per_row[j + 1] + fixed[j + 1]) of the data section, so one
    # printf template and one integer table give every sample's header.
    template, per_row, fixed, pick = ['{"__metadata__":%s'], [0], [0], []
    for j, (key, code, row_shape, row_bytes, flat) in enumerate(columns):
        shape = "" if row_bytes is None else "%d" + row_shape
        template.append(f',{key.replace("%", "%%")}:{{"dtype":"{code}","shape":[{shape}],"data_offsets":[%d,%d]}}')
        per_row.append(per_row[-1] + (row_bytes or 0))
        fixed.append(fixed[-1] + (flat.nbytes if row_bytes is None else 0))
        pick += ([0] if row_bytes is not None else []) + [j + 1, j + 2]  # column 0 of the table is n
    template = "".join(template) + "}"
    n_col = np.asarray(lens, dtype=np.int64)[:, None]
    table = np.concatenate([n_col, n_col * np.asarray(per_row) + np.asarray(fixed)], axis=1)[:, pick].tolist()
    blobs_of = [(row_bytes, memoryview(flat)) for _, _, _, row_bytes, flat in columns]
    names, out, start = json.dumps(list(sites)), [], 0
    for sid, n, values in zip(sample_ids, lens, table):
        meta = json.dumps({"sample_id": sid, "mode": mode, "num_positions": str(n), "sites": names})
        header = (template % (meta, *values)).encode()
        header += b" " * (-len(header) % 8)  # safetensors aligns the data section to 8 bytes
        blobs = [
            mv if row_bytes is None else mv[start * row_bytes : (start + n) * row_bytes] for row_bytes, mv in blobs_of
        ]
        out.append(b"".join([len(header).to_bytes(8, "little"), header, *blobs]))
        start += n
    return out


def _column(name: str, t: torch.Tensor, total: int) -> tuple:
    """(JSON key, dtype code, shape after the first dim, bytes per row or None when 0-d, bytes)."""
    if t.dtype not in _ST_DTYPES:
        raise ValueError(f"guidance tensor {name} has dtype {t.dtype}; records hold uint8 and float32")
    a = (
        t if t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad else t.detach().cpu().contiguous()
    ).numpy()
    flat = a.reshape(-1).view("u1")
    if a.ndim == 0:
        return _json_key(name), _ST_DTYPES[t.dtype], "", None, flat
    if a.shape[0] != total:
        raise ValueError(f"guidance tensor {name} holds {a.shape[0]} positions; the samples have {total}")
    row_shape = "".join(f",{d}" for d in a.shape[1:])
    row_bytes = a.itemsize * math.prod(a.shape[1:])
    return _json_key(name), _ST_DTYPES[t.dtype], row_shape, row_bytes, flat


@functools.lru_cache(maxsize=4096)
def _json_key(name: str) -> str:
    return json.dumps(name)  # site names repeat in every record: escape each once


_ST_DTYPES = {torch.uint8: "U8", torch.float32: "F32"}
_ST_TORCH = {v: k for k, v in _ST_DTYPES.items()}


def _header(data: bytes) -> dict:
    if len(data) < 8:
        raise ValueError("guidance record bytes are truncated (no safetensors header)")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise ValueError("guidance record bytes are truncated (header runs past the end)")
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except ValueError:
        raise ValueError("guidance record header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ValueError("guidance record header is not a JSON object")
    return header


def _checked_meta(meta) -> dict[str, str]:
    missing = {"sample_id", "mode", "num_positions", "sites"} - set(meta if isinstance(meta, dict) else {})
    if missing:
        raise ValueError(f"guidance record header lacks {sorted(missing)}")
    return meta


def _metadata(data: bytes) -> dict[str, str]:
    """The record's metadata (sample id, mode, positions, sites) without decoding any tensor."""
    return _checked_meta(_header(data).get("__metadata__", {}))


def _tensor(name: str, info, buf: np.ndarray) -> torch.Tensor:
    """One tensor of the data section (`buf`, uint8), checked: known dtype, offsets inside the
    data, size = shape; a view of `buf` when aligned, else a copy (numpy slices: a fraction of
    torch's per-call cost)."""
    try:
        dtype, shape, (start, end) = _ST_TORCH[info["dtype"]], [int(d) for d in info["shape"]], info["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"guidance tensor {name}: bad header entry {info!r} (U8/F32 with shape and offsets)") from None
    numel = 1
    for d in shape:
        numel *= d
    n = len(buf)
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= n) or min(shape, default=0) < 0:
        raise ValueError(f"guidance tensor {name}: data offsets {[start, end]} outside the {n} data bytes")
    if end - start != numel * (4 if dtype is torch.float32 else 1):
        raise ValueError(f"guidance tensor {name}: {end - start} bytes do not hold shape {shape} of {info['dtype']}")
    a = buf[start:end]
    if dtype is torch.float32:
        a = (a.copy() if start % 4 else a).view(np.float32)
    return torch.from_numpy(a.reshape(shape))


def layer_of(site: str) -> int:
    return int(site.split(".")[2])


def resolve_guided_layers(num_layers: int, spec: str | int | list[int] | None) -> list[int]:
    """Which layers are guided: "last_half" (default), "all", "none", an int N (the last N),
    or an explicit list of layer indices."""
    if spec in (None, "last_half"):
        return list(range(num_layers // 2, num_layers))
    if spec == "all":
        return list(range(num_layers))
    if spec == "none":
        return []
    if isinstance(spec, int) and not isinstance(spec, bool):
        if not 0 <= spec <= num_layers:
            raise ValueError(f"guidance.layers={spec} must be between 0 and the model's {num_layers} layers")
        return list(range(num_layers - spec, num_layers))
    if isinstance(spec, (list, tuple)) and all(isinstance(i, int) for i in spec):
        bad = [i for i in spec if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"guidance.layers has indices {bad} outside 0..{num_layers - 1}")
        return sorted(set(spec))
    raise ValueError(
        f"guidance.layers must be 'last_half', 'all', 'none', an int (last N) or a list of indices; got {spec!r}"
    )
