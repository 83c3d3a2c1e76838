"""The plugin's settings: what `sglang_backend.launch` tells the plugin code running inside SGLang.

SGLang imports the plugin through its entry point in its own processes (scheduler, TP workers),
where the project's config tree is not loaded and no argument of ours reaches; the launcher
therefore writes these settings into the server's environment (`to_env`) and the plugin reads
them back (`current()`). The variable names exist here only; nothing else of the plugin reads
the environment. It lives beside `plugin/`, not in it: the launcher imports it without
importing the plugin (which imports SGLang).

    launch.py: PluginSettings.from_env(os.environ) ─► replace(launcher's values) ─► to_env() ─► exec SGLang
    plugin:    current() ─► PluginSettings (parsed and checked once per distinct environment)
Settings the launcher does not decide (`fp4_kv`, `fp4_native`, `guidance_dir`) pass through from
the launcher's own environment, so an operator can still set them by hand.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from megatron_trace.kernels.kv_codec import FORMATS as SIDE_FORMATS

FP4_NATIVE_MODES = ("auto", "0")


def _env(name: str, default, help: str):
    return field(default=default, metadata={"env": name, "help": help})


@dataclass(frozen=True)
class PluginSettings:
    guidance_mode: str = _env("TRACE_GUIDANCE_MODE", "mantissa", "what a guidance record keeps per element")
    guided_layers: tuple[int, ...] | None = _env(
        "TRACE_GUIDED_LAYERS",
        None,
        "layer indices the server captures guidance of (the launcher resolves "
        "--guided-layers against the checkpoint); unset: no capture",
    )
    guidance_dir: str | None = _env(
        "TRACE_GUIDANCE_DIR",
        None,
        "where finished records are published (unset: /dev/shm/trace_guidance, else the temp dir)",
    )
    quant_policy: str | None = _env(
        "TRACE_QUANT_POLICY",
        None,
        "online quantization (trace_nvfp4/trace_mxfp4): "
        "JSON {'policy': QuantPolicy.to_dict(), 'num_layers': N}; unset: the default",
    )
    kv_sides: tuple[str, str] | None = _env(
        "TRACE_KV_SIDES",
        None,
        "K and V cache formats when they differ from SGLang's one --kv-cache-dtype (plugin/kv_sides.py)",
    )
    kv_k_debias: bool = _env(
        "TRACE_KV_K_DEBIAS",
        False,
        "a quantized K cache holds K minus its rotated k_proj bias (quant.kv_k_debias; plugin/kv_debias.py)",
    )
    kv_read_dtype: str = _env("TRACE_KV_READ_DTYPE", "float32", "the model dtype attention reads K/V in")
    fp4_kv: bool = _env(
        "TRACE_FP4_KV", True, "install the plugin's NVFP4 KV method (false keeps SGLang's, which records no guidance)"
    )
    fp4_native: str = _env("TRACE_FP4_NATIVE", "auto", "auto: SGLang's native FP4 GEMM on SM100+; 0: never")

    def __post_init__(self) -> None:
        from megatron_trace.fp4.guided import GUIDANCE_MODES  # here: the launcher imports this module before torch

        if self.guidance_mode not in GUIDANCE_MODES:
            raise ValueError(
                f"{env_name('guidance_mode')} must be one of {', '.join(GUIDANCE_MODES)}; got {self.guidance_mode!r}"
            )
        if self.fp4_native not in FP4_NATIVE_MODES:
            raise ValueError(
                f"{env_name('fp4_native')} must be one of {', '.join(FP4_NATIVE_MODES)}; got {self.fp4_native!r}"
            )
        if self.kv_sides is not None and (len(self.kv_sides) != 2 or any(s not in SIDE_FORMATS for s in self.kv_sides)):
            raise ValueError(
                f"{env_name('kv_sides')} must be '<K format>,<V format>' with each one of "
                f"{', '.join(SIDE_FORMATS)}; got {','.join(self.kv_sides)!r}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> PluginSettings:
        """The settings in `environ`; unset variables keep their defaults; a malformed one is an
        error naming the variable."""
        values = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(f.metadata["env"])
            if raw is not None:
                values[f.name] = _parse(f.name, raw)
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """Every setting that has a value, as the environment variables `from_env` reads."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, bool):
                value = "1" if value else "0"
            elif isinstance(value, tuple):
                value = ",".join(map(str, value))
            out[f.metadata["env"]] = str(value)
        return out


def env_names() -> tuple[str, ...]:
    """Every variable the plugin reads."""
    return tuple(f.metadata["env"] for f in dataclasses.fields(PluginSettings))


def env_name(attr: str) -> str:
    """The environment variable of setting `attr` (for messages and tests)."""
    return next(f.metadata["env"] for f in dataclasses.fields(PluginSettings) if f.name == attr)


def _parse(attr: str, raw: str):
    if attr == "guided_layers":
        try:
            return tuple(int(x) for x in raw.split(",") if x.strip())
        except ValueError:
            raise ValueError(
                f"{env_name(attr)} must be comma-separated layer indices (set by sglang_backend.launch); got {raw!r}"
            ) from None
    if attr == "kv_sides":
        parts = tuple(p.strip() for p in raw.split(","))
        if len(parts) != 2:
            raise ValueError(
                f"{env_name(attr)} must be '<K format>,<V format>' with each one of "
                f"{', '.join(SIDE_FORMATS)}; got {raw!r}"
            )
        return parts
    if attr in ("fp4_kv", "kv_k_debias"):
        if raw not in ("0", "1"):
            raise ValueError(f"{env_name(attr)} must be 0 or 1; got {raw!r}")
        return raw == "1"
    return raw


_CACHE: dict[tuple, PluginSettings] = {}


def current() -> PluginSettings:
    """This process's settings. Parsed once per distinct environment (the hot paths ask per forward;
    a test that changes the environment gets the new values)."""
    key = tuple(os.environ.get(name) for name in env_names())
    found = _CACHE.get(key)
    if found is None:
        found = _CACHE[key] = PluginSettings.from_env()
    return found
