"""Blackwell tensor-core layout of NVFP4 block scales (128x4 tiles, as cuBLASLt/CUTLASS read them).

Byte offset of the scale of row m, K-block k, with KT = ceil(K/64) tiles along K:
    ((m // 128) * KT + k // 4) * 512 + (m % 32) * 16 + ((m // 32) % 4) * 4 + k % 4
The result is zero padded to [roundup(M, 128), roundup(K/16, 4)].
"""

from __future__ import annotations

import torch


def _roundup(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """[..., M, K/16] linear uint8 scales -> [..., roundup(M,128), roundup(K/16,4)] swizzled bytes."""
    if scale.dtype != torch.uint8 or scale.dim() < 2:
        raise ValueError(f"swizzle_scales takes uint8 [..., M, K/16] scales; got {scale.dtype} {tuple(scale.shape)}")
    *lead, m, kb = scale.shape
    mp, kp = _roundup(m, 128), _roundup(kb, 4)
    padded = torch.zeros(*lead, mp, kp, dtype=torch.uint8, device=scale.device)
    padded[..., :m, :kb] = scale
    tiles = padded.reshape(*lead, mp // 128, 4, 32, kp // 4, 4)  # [MT, i=(m//32)%4, j=m%32, KT, l=k%4]
    n = len(lead)
    perm = [*range(n), n, n + 3, n + 2, n + 1, n + 4]  # -> [MT, KT, j, i, l]
    return tiles.permute(perm).contiguous().reshape(*lead, mp, kp)


def unswizzle_scales(swizzled: torch.Tensor, m: int, kb: int) -> torch.Tensor:
    """Inverse of swizzle_scales: back to linear [..., m, kb]."""
    *lead, mp, kp = swizzled.shape
    n = len(lead)
    tiles = swizzled.reshape(*lead, mp // 128, kp // 4, 32, 4, 4)  # [MT, KT, j, i, l]
    perm = [*range(n), n, n + 3, n + 2, n + 1, n + 4]  # -> [MT, i, j, KT, l]
    return tiles.permute(perm).contiguous().reshape(*lead, mp, kp)[..., :m, :kb]
