"""TRACE guidance: the record layout (what the rollout rounded to) and, later, its store."""

from .record import (
    GUIDANCE_MODES,
    KV_SITES,
    GuidanceRecord,
    SiteRecord,
    concat_sites,
    encode_records,
    make_site,
    quantized_parts,
    resolve_guided_layers,
)
from .routing import decode_routed_experts, encode_routed_experts
from .store import GuidanceStore, GuidanceStoreError

__all__ = [
    "GUIDANCE_MODES",
    "KV_SITES",
    "GuidanceRecord",
    "SiteRecord",
    "concat_sites",
    "encode_records",
    "make_site",
    "quantized_parts",
    "resolve_guided_layers",
    "GuidanceStore",
    "GuidanceStoreError",
    "decode_routed_experts",
    "encode_routed_experts",
]
