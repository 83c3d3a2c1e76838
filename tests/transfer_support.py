"""Helpers shared by the transfer tests (test_transfer.py, test_transfer_export.py): the environment
of the processes they start, and the check that an engine's FP4 linears hold the exporter's bits."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron_trace.fp4.modelopt import encode_scale_from_decode, to_modelopt_fused
from megatron_trace.models import ModelArch
from sglang_backend.local import Engine

REPO = Path(__file__).resolve().parents[1]


def subprocess_env() -> dict:
    """The environment of a test's child process: offline, one thread, CPU only, this checkout importable."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": str(REPO),
    }


def fp4_linears(engine: Engine):
    """(layer index, linear name, EngineLinear) for every linear of the engine holding FP4 weights."""
    for i, layer in enumerate(engine.model.layers):
        for attr in ("qkv", "o_proj", "gate_up", "down"):
            lin = getattr(layer, attr, None)
            if lin is not None and lin.qweight is not None:
                yield i, attr, lin
        for kind in ("gate_up", "down"):
            for e, lin in enumerate(getattr(layer, f"experts_{kind}", None) or []):
                if lin.qweight is not None:
                    yield i, f"expert{e}.{kind}", lin


def assert_fp4_equals(engine: Engine, hf: dict, arch: ModelArch):
    """Every FP4 linear of the engine holds to_modelopt_fused(HF weights) bit for bit."""
    shards = {
        "qkv": ("self_attn", "qkv"),
        "gate_up": ("mlp", ("gate", "up")),
        "down": ("mlp", ("down",)),
        "o_proj": ("self_attn", ("o",)),
    }
    n = 0
    for i, attr, lin in fp4_linears(engine):
        if attr.startswith("expert"):
            e, kind = attr[6:].split(".")
            leaves = ("gate", "up") if kind == "gate_up" else ("down",)
            names = [f"model.layers.{i}.mlp.experts.{e}.{x}_proj.weight" for x in leaves]
        else:
            parent, leaves = shards[attr]
            names = [f"model.layers.{i}.{parent}.{x}_proj.weight" for x in leaves]
        want = to_modelopt_fused([hf[x] for x in names])
        assert torch.equal(lin.qweight.data, torch.cat([w["weight"] for w in want])), (i, attr)
        assert torch.equal(lin.qweight.scale, torch.cat([w["weight_scale"].view(torch.uint8) for w in want]))
        gs = encode_scale_from_decode(want[0]["weight_scale_2"])
        assert torch.equal(lin.qweight.global_scale, gs.expand(lin.out_features)), (i, attr)
        n += 1
    assert n > 0
