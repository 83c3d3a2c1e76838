"""Make Megatron-Core (0.16.x, tolerant of 0.19.x) run on CPU-only machines with gloo.

Every CPU workaround of the trainer lives here, in `apply_cpu_workarounds()`. It does nothing when
CUDA is available, so a GPU run executes Megatron's own code unchanged. Each item below is a
place where Megatron assumes a GPU even though the computation itself is device-agnostic:

1. `torch.cuda.current_device()` is used as an allocation device in >30 modules (the global
   memory buffer in `utils.py`, pipeline p2p shape exchange, the MoE router, DDP buffers, ...),
   so `torch.cuda.current_device` is replaced by one returning the CPU device. Without CUDA the
   original can only raise, so no working code path changes meaning.
2. The model-parallel RNG tracker stores CUDA generator states (`model_parallel_cuda_manual_seed`
   -> `torch.cuda.get_rng_state`). `CudaRNGStatesTracker` is swapped, in its module, for
   `CpuRNGStatesTracker`, which keeps the same named states of the CPU generator, so
   `model_parallel_cuda_manual_seed` and `get_cuda_rng_tracker().fork()` keep their semantics.
3. Literal `device="cuda"` (token counting in the pipeline schedules, the optimizer's scale
   tensors, the default causal mask, the grad buffer) and `torch.cuda.synchronize/stream` calls:
   in the listed modules only, the module-global name `torch` is rebound to `_CpuTorch`, a thin
   proxy that maps CUDA devices to CPU in tensor factories and makes stream calls no-ops.
4. `clip_grads.clip_grad_by_total_norm_fp32` asserts `torch.cuda.FloatTensor` grads and the
   norm uses CUDA multi-tensor kernels: both functions are replaced by CPU ones doing the same
   math, including the all-reduce of the norm over the model-parallel (grad-stats) group.
5. 0.19.x calls `torch.cuda.current_stream()` in the grad buffer's `start_grad_sync`; covered by
   the item-3 proxy (its `cuda.current_stream()` is a dummy stream) in `param_and_grad_buffer`.
6. The MoE router calls `moe_utils.te_general_gemm`, defined only when Transformer Engine imports
   (NameError in 0.16.1): set to None so the plain matmul path runs.
7. `megatron.core.jit` binds `jit_fuser = torch.compile` at import and ~40 fusion kernels are
   decorated with it while `megatron.core` loads: that alone imports dynamo and inductor (~3 s of
   every process's start-up here), and a fused kernel called on CPU would be compiled to C++ by
   inductor. Megatron's first import therefore runs with `torch.compile` as a pass-through, so
   `jit_fuser` is Megatron's own no-op choice and the kernels run eagerly (same math).
8. Activation recompute (`tensor_parallel.checkpoint`) saves and restores the CUDA generator's
   state beside the CPU one (`_get_cuda_rng_state` / `_set_cuda_rng_state`): without CUDA there is
   none, so they save and restore nothing (the CPU generator and the tracker's named CPU states
   are still saved and restored).
9. The bf16 optimizer (`Float16OptimizerWithFloat16Params`, fp32 main copies of bf16 params: what
   `trainer.dtype=bfloat16` runs) sorts params by `param.type()`, accepting only the
   `torch.cuda.*Tensor` names. Its `__init__` runs with `Tensor.type()` naming a CPU tensor by its
   CUDA twin (`torch.BFloat16Tensor` -> `torch.cuda.BFloat16Tensor`); nothing else changes.

Limits that are configuration, not patches (see `gpt.build_model`): the alltoall MoE token
dispatcher needs CUDA streams (use "allgather") and `use_distributed_optimizer=True` rejects CPU
params (use the plain optimizer). Sequence parallelism runs on gloo with the project's layer spec
(`layer_spec.py`: its norms allow it, where Megatron's WrappedTorchNorm refuses it).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import sys
import types
from typing import Any

import torch

_APPLIED = False

# Modules whose module-global `torch` gets the item-3 proxy. Missing ones (other versions) are skipped.
_PROXIED_MODULES = (
    "megatron.core.utils",
    "megatron.core.transformer.utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
)
_FACTORIES = (
    "zeros",
    "ones",
    "empty",
    "full",
    "tensor",
    "arange",
    "rand",
    "randn",
    "zeros_like",
    "ones_like",
    "empty_like",
)


def _cpu_device(device: Any) -> Any:
    """Map any CUDA device spelling to CPU; leave everything else alone."""
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _DummyStream:
    """Stands in for a CUDA stream: all ordering is trivially satisfied on CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args: Any) -> None:
        return None


class _CpuCuda(types.ModuleType):
    """`torch.cuda` as seen by proxied modules: device/stream helpers that work without CUDA."""

    def __init__(self) -> None:
        super().__init__("torch.cuda (cpu shim)")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(*args: Any) -> None:
        pass

    @staticmethod
    def current_stream(*args: Any) -> _DummyStream:
        return _DummyStream()

    default_stream = current_stream
    Stream = _DummyStream

    @staticmethod
    def stream(*args: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class _CpuTorch(types.ModuleType):
    """`torch` as seen by proxied modules: identical except CUDA devices in factories become CPU."""

    def __init__(self) -> None:
        super().__init__("torch (cpu shim)")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, self._wrap(getattr(torch, name)))

    @staticmethod
    def _wrap(fn: Any) -> Any:
        def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return fn(*args, **kwargs)

        factory.__name__ = fn.__name__
        return factory

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _make_cpu_tracker(base: type) -> type:
    class CpuRNGStatesTracker(base):  # type: ignore[valid-type, misc]
        """Megatron's RNG tracker over the CPU generator (item 2): named states are CPU RNG
        states; `fork(name)` swaps one in for the block and saves its advanced state after."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    CpuRNGStatesTracker.cpu_shim = True
    return CpuRNGStatesTracker


def _cpu_get_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None) -> float:
    """Item 4: Megatron's `get_grad_norm_fp32` on CPU (sum of |g|^p all-reduced over the group)."""
    from megatron.core.utils import get_data_parallel_group_if_dtensor, to_local_if_dtensor

    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    dp_group = None
    for g in grads_for_norm:
        dp_group = get_data_parallel_group_if_dtensor(g, dp_group)
    grads = [to_local_if_dtensor(g).float() for g in grads_for_norm]
    norm_type = float(norm_type)
    if norm_type == math.inf:
        total = torch.tensor(max((g.abs().max().item() for g in grads), default=0.0))
        op = torch.distributed.ReduceOp.MAX
    else:
        total = torch.zeros((), dtype=torch.float32)
        for g in grads:
            total += torch.linalg.vector_norm(g, norm_type) ** norm_type
        op = torch.distributed.ReduceOp.SUM
    # Same reductions as Megatron: FSDP data-parallel group (if any), then the model-parallel one.
    if dp_group:
        torch.distributed.all_reduce(total, op=op, group=dp_group)
    torch.distributed.all_reduce(total, op=op, group=grad_stats_parallel_group)
    return total.item() if norm_type == math.inf else total.item() ** (1.0 / norm_type)


def _cpu_clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False) -> None:
    """Item 4: scale grads in place by max_norm / (total_norm + 1e-6) when that is < 1 (same
    formula as Megatron), without the `torch.cuda.FloatTensor` assertion."""
    from megatron.core.utils import to_local_if_dtensor

    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [to_local_if_dtensor(getattr(p, attr)).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.mul_(clip_coeff)


def _cuda_named_float16_init(init: Any) -> Any:
    """Item 9: run the bf16 optimizer's `__init__` with CPU tensors typed by their CUDA names."""

    def cpu_init(self: Any, *args: Any, **kwargs: Any) -> None:
        real_type = torch.Tensor.type

        def cuda_name(t: torch.Tensor, *a: Any, **k: Any) -> Any:
            name = real_type(t, *a, **k)
            if a or k or t.is_cuda:
                return name
            return name.replace("torch.", "torch.cuda.", 1)

        torch.Tensor.type = cuda_name  # type: ignore[method-assign]
        try:
            init(self, *args, **kwargs)
        finally:
            torch.Tensor.type = real_type  # type: ignore[method-assign]

    cpu_init.cpu_shim = True  # type: ignore[attr-defined]
    return cpu_init


@contextlib.contextmanager
def _compile_as_identity():
    """Item 7: `torch.compile(fn)` and `@torch.compile(...)` return the function unchanged."""

    def identity(model=None, **_kwargs):
        return model if model is not None else (lambda fn: fn)

    original = torch.compile
    torch.compile = identity  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = original


def apply_cpu_workarounds() -> bool:
    """Patch Megatron-Core for CPU execution when CUDA is absent. Idempotent.

    Returns True if the patches are (now) active, False on a CUDA machine (nothing patched).
    """
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    # 7. First import of Megatron with torch.compile as a pass-through.
    if "megatron.core" not in sys.modules:
        with _compile_as_identity():
            importlib.import_module("megatron.core")
    # 1. Allocation device.
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    # 3 + 5. Per-module torch proxy for literal "cuda" devices and stream calls.
    proxy = _CpuTorch()
    for mod_name in _PROXIED_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        if getattr(mod, "torch", None) is torch:
            mod.torch = proxy
    # 2. RNG tracker on the CPU generator.
    from megatron.core.tensor_parallel import random as mrandom

    if not getattr(mrandom.CudaRNGStatesTracker, "cpu_shim", False):
        mrandom.CudaRNGStatesTracker = _make_cpu_tracker(mrandom.CudaRNGStatesTracker)
        # A tracker created before this call holds the CUDA class: have the next seeding rebuild it.
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    # 4. Gradient norm / clipping, patched where they are defined and where they were imported.
    for mod_name in (
        "megatron.core.optimizer.clip_grads",
        "megatron.core.optimizer.optimizer",
        "megatron.core.optimizer.layer_wise_optimizer",
    ):
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        if hasattr(mod, "get_grad_norm_fp32"):
            mod.get_grad_norm_fp32 = _cpu_get_grad_norm_fp32
        if hasattr(mod, "clip_grad_by_total_norm_fp32"):
            mod.clip_grad_by_total_norm_fp32 = _cpu_clip_grad_by_total_norm_fp32
    # 8. Recompute's CUDA generator state.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    # 9. The bf16 optimizer's CUDA-only parameter type check.
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params as F16

    if not getattr(F16.__init__, "cpu_shim", False):
        F16.__init__ = _cuda_named_float16_init(F16.__init__)
    # 6. Router GEMM without Transformer Engine.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _APPLIED = True
    return True
