"""Pack units of rollout tensors into `WeightBucket`s under a byte budget.

A unit (one fused group's or one module's tensors, see quantize.py) is never split across
buckets: the receiver loads q/k/v or gate/up into one fused GEMM with one global scale, and a
ModelOpt linear needs its weight, weight_scale and weight_scale_2 together. A unit larger than
the budget travels alone in an oversized bucket (it cannot be split), which `BucketStats`
records. Every floating tensor is checked for NaN/Inf before it enters a bucket, so a bad
parameter raises here, naming it, before its bucket is sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from sglang_backend.api import WeightBucket

from .quantize import Unit, check_finite


def _nbytes(unit: Unit) -> int:
    return sum(t.numel() * t.element_size() for _, t in unit)


@dataclass
class BucketStats:
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    max_bucket_bytes: int = 0
    oversized_units: int = 0  # units bigger than the budget (sent alone)
    peak_held_bytes: int = 0  # max bytes the packer held at once (open bucket + incoming unit)


def pack_buckets(
    units: Iterable[Unit],
    version: int,
    bucket_mb: float = 512.0,
    *,
    budget_bytes: int | None = None,
    stats: BucketStats | None = None,
) -> Iterator[WeightBucket]:
    """Yield buckets of whole units, each at most `bucket_mb` MiB unless one unit alone exceeds it."""
    budget = int(budget_bytes if budget_bytes is not None else bucket_mb * (1 << 20))
    if budget <= 0:
        raise ValueError(f"bucket budget must be > 0 bytes; got {budget}")
    stats = stats if stats is not None else BucketStats()
    current: dict = {}
    size = 0

    def emit() -> WeightBucket:
        nonlocal current, size
        b = WeightBucket(current, version)
        stats.buckets += 1
        stats.tensors += len(current)
        stats.bytes += size
        stats.max_bucket_bytes = max(stats.max_bucket_bytes, size)
        current, size = {}, 0
        return b

    for unit in units:
        for name, t in unit:
            check_finite(name, t)
            if name in current:
                raise ValueError(f"tensor {name!r} appears twice in one transfer")
        n = _nbytes(unit)
        stats.peak_held_bytes = max(stats.peak_held_bytes, size + n)
        if current and size + n > budget:
            yield emit()
        if n > budget:
            stats.oversized_units += 1
        current.update(unit)
        size += n
    if current:
        yield emit()
