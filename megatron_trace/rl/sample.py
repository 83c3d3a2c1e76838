"""One answer from the rollout on, and the GRPO advantages of a step's groups.

    rollout result ─► Sample (tokens, the rollout's logprobs, its weight version, reward,
                      routed experts, the guidance record or the store's handle for it)
                   ─► grpo_advantages over each prompt's group ─► the trainer's micro-batches
The run, the store and the trainer pass Samples as they are; only a process boundary (the trainer's
other ranks) turns them into JSON and bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron_trace.guidance import GuidanceRecord, StoredRecord


@dataclass
class Sample:
    sample_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    advantage: float = 0.0
    # TRACE: the rollout's codewords and scales; while the step waits, the store's handle for them
    guidance: GuidanceRecord | StoredRecord | None = None
    routed_experts: torch.Tensor | None = None  # the rollout's expert ids [T, layers, top_k] (MoE)
    reward: float = 0.0
    version: int = 0  # the weight version that generated it
    prompt_id: str = ""

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def grpo_advantages(rewards: list[float], group: int) -> list[float]:
    """(r - group mean) / (group std + 1e-6); a group with one reward value teaches nothing: 0."""
    out = []
    for i in range(0, len(rewards), group):
        g = torch.tensor(rewards[i : i + group], dtype=torch.float64)
        std = g.std(unbiased=False)
        adv = (g - g.mean()) / (std + 1e-6) if std > 0 else torch.zeros_like(g)
        out += adv.tolist()
    return out
