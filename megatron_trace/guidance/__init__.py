"""TRACE guidance: the record layout (what the rollout rounded to), its store, and the routed experts' wire form."""

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
    split_records,
)
from .routing import decode_routed_experts, encode_routed_experts, sample_routed_experts, wire_routed_experts
from .store import GuidanceStore, GuidanceStoreError, StoredRecord

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
    "StoredRecord",
    "decode_routed_experts",
    "encode_routed_experts",
    "sample_routed_experts",
    "wire_routed_experts",
    "split_records",
]
