"""Rotary position embedding facts both sides share (HF's non-interleaved rotate_half form, fp32): the
embedded engine's RoPE (sglang_backend/local/layers.py Rope) and the de-biased K cache's offsets.

Used for K's de-biased cache (`quant.kv_k_debias`): Qwen2/2.5's k_proj bias b is one constant
vector per KV head that RoPE turns with the position, and it is what puts K's outlier channels
there (per-layer K amax up to 216 on a real Qwen2.5-0.5B). The cache stores K - RoPE_pos(b) and
adds RoPE_pos(b) back when it reads: both terms are exact functions of the position and the
weights, so the rollout and the trainer compute the same offset from this one function.
"""

from __future__ import annotations

import torch


def inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos, sin [T, D] of positions [T]."""
    freqs = positions.float()[:, None] * inv_freq(head_dim, theta, positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotated_bias(bias: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE_pos(b) in fp32 [T, G, D] for a K bias [G, D] (one vector per KV head) at positions [T]."""
    cos, sin = rotary_tables(positions, bias.shape[-1], theta)
    return rotate_bias(bias, cos, sin)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with cos/sin broadcast against x [..., D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rotate_bias(bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE(b) [T, G, D] with fp32 tables [T, D] from `rotary_tables` (one table serves every layer's b)."""
    return apply(bias.detach().float()[None], cos[:, None], sin[:, None])


class ColumnOffsets:
    """RoPE_j(b) for columns j = 0..width-1 (a de-biased K cache's offsets by position), computed for a
    power-of-two width and kept until the caller's key for b changes: decode widths grow by one a step."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim, self.theta, self._key, self._table = head_dim, theta, None, None

    def rows(self, bias: torch.Tensor, width: int, key) -> torch.Tensor:
        """fp32 [width, G, D], contiguous, for the bias [G, D] the caller names by `key`."""
        cap = 1 << max(width - 1, 0).bit_length()
        if self._key != (cap, key):
            cos, sin = rotary_tables(torch.arange(cap), self.head_dim, self.theta)
            self._key, self._table = (cap, key), rotate_bias(bias, cos, sin).contiguous()
        return self._table[:width]
