"""Weight updates into a real SGLang server are checked as a whole bucket before any tensor is loaded.

SGLang 0.5.23 hands an update's tensors straight to `model.load_weights` (model_executor/
model_runner_components/weight_updater.py): an unknown name is skipped without a word, a wrong
shape fails inside a weight loader half way through the bucket (on the tensor path the exception
kills the scheduler; on the distributed path the model is left partially updated). The plugin
records, during the server's own first load (`DefaultModelLoader.load_weights_only`), the name,
shape and dtype of every checkpoint tensor the model took (plus the forms its quant config says an
update may take instead: `weight_update_alternates`, the online NVFP4 method's ModelOpt tensors);
AROUND hooks on the weight updater's
three entry points compare the whole update with that record first and answer SGLang's own
`(False, message)` when anything differs, so the HTTP route returns 400 `{"success": false,
"message": ...}` naming the tensors, nothing is loaded and the served version stays the previous
one.

Dtypes: BF16/FP16/FP32 stand for each other (SGLang's loaders cast floating weights), E4M3 scale
bytes may travel as uint8 (gloo cannot broadcast float8; the plugin's loader reinterprets them),
every other dtype (packed FP4 codes: uint8) must be the checkpoint's.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SPEC_ATTR = "_trace_weight_spec"
UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater."
LOAD_TARGET = "sglang.srt.model_loader.loader.DefaultModelLoader.load_weights_only"
HOOK_TARGETS = {
    UPDATER + "update_weights_from_tensor": "check_tensor_update",
    UPDATER + "load_weights_from_distributed": "check_distributed_update",
    UPDATER + "update_weights_from_disk": "check_disk_update",
}
_FLOATS = frozenset({torch.float32, torch.bfloat16, torch.float16})
_E4M3 = frozenset({torch.uint8, torch.float8_e4m3fn})  # E4M3 bytes, also as uint8 (not the other way round)
SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BOOL": torch.bool,
    "F64": torch.float64,
}
MAX_LISTED = 5


def record_first_load(original, model, weights, *args, **kwargs):
    """AROUND DefaultModelLoader.load_weights_only: remember what the model's first load took."""
    if getattr(model, SPEC_ATTR, None) is not None:
        return original(model, weights, *args, **kwargs)
    spec: dict[str, list[tuple[tuple[int, ...], torch.dtype]]] = {}

    def recording(items):
        for name, t in items:
            spec[name] = [(tuple(t.shape), t.dtype)]
            yield name, t

    out = original(model, recording(weights), *args, **kwargs)
    # a quant config may take other forms of some tensors (online NVFP4: the trainer's ModelOpt tensors)
    alternates = getattr(getattr(model, "quant_config", None), "weight_update_alternates", None)
    for name, forms in (alternates(spec) if callable(alternates) else {}).items():
        spec.setdefault(name, []).extend(forms)
    setattr(model, SPEC_ATTR, spec)
    log.info("trace_fp4: %d checkpoint tensors recorded for checking weight updates", len(spec))
    return out


def _allowed(want: torch.dtype) -> frozenset:
    return _FLOATS if want in _FLOATS else _E4M3 if want == torch.float8_e4m3fn else frozenset({want})


def problems(spec: dict | None, items) -> list[str]:
    """What is wrong with an update of (name, shape, dtype) items against the recorded first load."""
    if spec is None:
        return [
            "this server recorded no first load of its checkpoint (the plugin's hook on "
            f"{LOAD_TARGET} did not run), so the update cannot be checked"
        ]
    out, seen = [], set()
    for name, shape, dtype in items:
        dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).removeprefix("torch."), dtype)
        forms = spec.get(name)
        fits = [d for s, d in forms or () if s == tuple(shape)]
        allowed = frozenset().union(*map(_allowed, fits))
        if name in seen:
            out.append(f"{name!r}: given twice")
        elif forms is None:
            out.append(
                f"{name!r}: no such tensor in the served checkpoint ({len(spec)} tensors, e.g. "
                f"{next(iter(spec), '-')!r})"
            )
        elif not fits:
            out.append(
                f"{name!r}: shape {list(shape)}, the served model takes " + " or ".join(str(list(s)) for s, _ in forms)
            )
        elif dtype not in allowed:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in allowed))
            out.append(f"{name!r}: dtype {str(dtype).removeprefix('torch.')}, the served model takes {names}")
        seen.add(name)
    return out


def refusal(found: list[str]) -> tuple[bool, str]:
    more = f" (and {len(found) - MAX_LISTED} more)" if len(found) > MAX_LISTED else ""
    msg = (
        "weight update refused before loading, the served weights and version are unchanged: "
        + "; ".join(found[:MAX_LISTED])
        + more
    )
    log.error("trace_fp4: %s", msg)
    return False, msg


def _spec(updater) -> dict | None:
    return getattr(updater.get_model(), SPEC_ATTR, None)


def check_tensor_update(original, self, named_tensors, load_format=None, *args, **kwargs):
    """AROUND WeightUpdater.update_weights_from_tensor: SGLang's payload is unwrapped once here (this
    rank's tensors), checked, and handed on unwrapped."""
    if load_format == "flattened_bucket":
        items = [(m.name, m.shape, m.dtype) for m in named_tensors["metadata"]]
    else:
        from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
        from sglang.srt.runtime_context import get_parallel
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()  # as the original does before deserializing
        rank = get_parallel().tp_rank
        named_tensors = [(n, t.get(rank) if isinstance(t, LocalSerializedTensor) else t) for n, t in named_tensors]
        items = [(n, tuple(t.shape), t.dtype) for n, t in named_tensors]
    found = problems(_spec(self), items)
    if found:
        return refusal(found)
    return original(self, named_tensors, load_format, *args, **kwargs)


def check_distributed_update(original, self, named_tensors, *args, **kwargs):
    """AROUND WeightUpdater.load_weights_from_distributed: the received tensors, before load_weights."""
    named_tensors = list(named_tensors)
    found = problems(_spec(self), [(n, tuple(t.shape), t.dtype) for n, t in named_tensors])
    if found:
        return refusal(found)
    return original(self, named_tensors, *args, **kwargs)


def safetensors_header(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype | str]]:
    """name -> (shape, dtype) from a .safetensors file's header (no tensor data is read)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return {
        k: (tuple(v["shape"]), SAFETENSORS_DTYPES.get(v["dtype"], v["dtype"]))
        for k, v in header.items()
        if k != "__metadata__"
    }


def check_disk_update(original, self, model_path, load_format, *args, **kwargs):
    """AROUND WeightUpdater.update_weights_from_disk: the directory's safetensors headers, before loading."""
    files = sorted(Path(model_path).glob("*.safetensors")) if Path(model_path).is_dir() else []
    if load_format in ("auto", "safetensors", None) and files:
        items = []
        for f in files:
            try:
                items += [(n, s, d) for n, (s, d) in safetensors_header(f).items()]
            except (OSError, ValueError, struct.error) as e:
                return refusal([f"{f}: not a readable safetensors file ({e})"])
        found = problems(_spec(self), items)
        if found:
            return refusal(found)
    return original(self, model_path, load_format, *args, **kwargs)
