"""Routed expert ids of a rollout (MoE routing replay, R3): one format on both rollout stacks.

    rollout ─► per position t (prompt and response, like a guidance record's T) and per decoder
               layer l: the top-k expert ids the rollout's router chose, in its top-k order
            ─► [T, num_layers, top_k] int32 (in process: the tensor itself)
            ─► over HTTP: base64 of the raw little-endian bytes (the wire form, decoded by the client)
This is SGLang's own form (`meta_info["routed_experts"]` with `return_routed_experts`; its
`extract_routed_experts_from_meta_info` decodes it as a flat int32 array): every hidden layer
has a row, and the positions are [0, prompt + output - 1), the last sampled token never having
run through the model. Dense layers of a mixed model hold whatever the server left there; the
trainer reads the MoE layers only. The top-k order matters: a routed slot's guidance (the
down_proj input record is [T, top_k, K]) is the slot's position in that order.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np
import torch


def encode_routed_experts(ids: torch.Tensor) -> str:
    """[T, num_layers, top_k] integer expert ids -> SGLang's base64 int32 string."""
    if ids.dim() != 3:
        raise ValueError(f"routed experts must be [positions, layers, top_k]; got shape {tuple(ids.shape)}")
    a = ids.detach().to("cpu", torch.int32).contiguous().numpy().astype("<i4", copy=False)
    return base64.b64encode(a.tobytes()).decode("ascii")


def wire_routed_experts(data: str, sample: str = "?") -> torch.Tensor:
    """SGLang's base64 string -> the flat int32 ids it holds (the shape is the sample's: see
    decode_routed_experts); what the client makes of `meta_info["routed_experts"]`."""
    if not isinstance(data, str):
        raise ValueError(f"sample {sample}: routed_experts must be a base64 string; got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"sample {sample}: routed_experts is not valid base64") from None
    if len(raw) % 4:
        raise ValueError(f"sample {sample}: routed_experts holds {len(raw)} bytes, not whole int32 ids")
    return torch.from_numpy(np.frombuffer(raw, dtype="<i4").astype(np.int32))


def decode_routed_experts(
    data: str | torch.Tensor,
    num_positions: int,
    num_layers: int,
    top_k: int,
    num_experts: int | None = None,
    sample: str = "?",
) -> torch.Tensor:
    """A sample's routed experts (the wire's base64 string, or the ids as a tensor of any shape) ->
    int32 [num_positions, num_layers, top_k], checked: the id count must be exactly that shape (a
    server serving another model, or one that cut the positions, is an error naming both shapes)
    and, given num_experts, every id in [0, num_experts)."""
    flat = wire_routed_experts(data, sample) if isinstance(data, str) else data.reshape(-1).to(torch.int32)
    want = num_positions * num_layers * top_k
    if flat.numel() != want:
        raise ValueError(
            f"sample {sample}: routed_experts holds {flat.numel()} int32 ids; the sample needs "
            f"{num_positions} positions x {num_layers} layers x top-{top_k} = {want} "
            "(a server of another model, or routed experts of a different position range)"
        )
    ids = flat.view(num_positions, num_layers, top_k)
    if num_experts is not None and want and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise ValueError(
            f"sample {sample}: routed_experts ids span [{int(ids.min())}, {int(ids.max())}]; "
            f"the model has experts 0..{num_experts - 1}"
        )
    return ids


def sample_routed_experts(ids, prompt_len: int, response_len: int, arch, sample: str = "?") -> torch.Tensor | None:
    """A rollout result's routed experts as the sample's [prompt + response - 1, layers, top_k] for
    `arch` (a `models.ModelArch`), checked as decode_routed_experts does; None when it sent none."""
    if ids is None:
        return None
    return decode_routed_experts(
        ids, prompt_len + response_len - 1, arch.num_layers, arch.num_experts_per_tok, arch.num_experts, sample
    )
