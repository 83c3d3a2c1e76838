"""The plugin's weight-update check (plugin/weight_check.py) without a server: what the first load
records, which updates it refuses and how the refusal reads (the real server: test_sglang_weight_sync)."""

from __future__ import annotations

import torch
from safetensors.torch import save_file
from torch import nn

from sglang_backend.plugin import weight_check


def _first_load(tensors: dict[str, torch.Tensor]) -> nn.Module:
    model = nn.Module()
    taken = []
    weight_check.record_first_load(lambda m, w, *_: taken.extend(n for n, _ in w), model, iter(tensors.items()), "cpu")
    assert taken == list(tensors)  # the original loader still sees every tensor, in order
    return model


CKPT = {
    "model.embed_tokens.weight": torch.zeros(8, 4),
    "model.layers.0.mlp.down_proj.weight": torch.zeros(4, 8, dtype=torch.uint8),
    "model.layers.0.mlp.down_proj.weight_scale": torch.zeros(4, 1, dtype=torch.float8_e4m3fn),
    "model.layers.0.mlp.down_proj.weight_scale_2": torch.zeros(()),
}


def test_first_load_is_recorded_once():
    model = _first_load(CKPT)
    spec = getattr(model, weight_check.SPEC_ATTR)
    assert spec["model.layers.0.mlp.down_proj.weight"] == [((4, 8), torch.uint8)] and len(spec) == 4
    weight_check.record_first_load(lambda *a: None, model, iter([("other", torch.zeros(1))]), "cpu")
    assert getattr(model, weight_check.SPEC_ATTR) is spec  # a disk update later does not replace it


def test_updates_that_fit_pass_and_everything_else_is_named():
    spec = getattr(_first_load(CKPT), weight_check.SPEC_ATTR)
    ok = [
        ("model.embed_tokens.weight", (8, 4), torch.bfloat16),  # floats cast by SGLang's loaders
        ("model.layers.0.mlp.down_proj.weight_scale", (4, 1), torch.uint8),  # E4M3 bytes over gloo
        ("model.layers.0.mlp.down_proj.weight", (4, 8), "uint8"),
    ]  # dtype names as SGLang's requests give them
    assert weight_check.problems(spec, ok) == []
    bad = [
        ("model.layers.0.mlp.nope.weight", (4, 8), torch.uint8),
        ("model.layers.0.mlp.down_proj.weight", (4, 7), torch.uint8),
        ("model.layers.0.mlp.down_proj.weight_scale_2", (), torch.int32),
        ("model.embed_tokens.weight", (8, 4), torch.uint8),
        ("model.embed_tokens.weight", (8, 4), torch.float32),
    ]
    found = weight_check.problems(spec, bad)
    assert found[0].startswith("'model.layers.0.mlp.nope.weight': no such tensor in the served checkpoint (4 tensors")
    assert found[1] == "'model.layers.0.mlp.down_proj.weight': shape [4, 7], the served model takes [4, 8]"
    assert found[2] == (
        "'model.layers.0.mlp.down_proj.weight_scale_2': dtype int32, the served model takes bfloat16, float16, float32"
    )
    assert found[3].endswith("dtype uint8, the served model takes bfloat16, float16, float32")
    assert found[4] == "'model.embed_tokens.weight': given twice"
    fp4_as_fp8 = [("model.layers.0.mlp.down_proj.weight", (4, 8), torch.float8_e4m3fn)]  # codes stay uint8
    assert weight_check.problems(spec, fp4_as_fp8)[0].endswith("dtype float8_e4m3fn, the served model takes uint8")
    ok_, msg = weight_check.refusal(found)
    assert not ok_ and msg.startswith(
        "weight update refused before loading, the served weights and version are "
        "unchanged: 'model.layers.0.mlp.nope.weight'"
    )
    many = weight_check.refusal([f"p{i}" for i in range(8)])[1]
    assert many.endswith("p4 (and 3 more)")
    assert "recorded no first load" in weight_check.problems(None, ok)[0]


def test_disk_update_is_checked_from_the_safetensors_headers(tmp_path):
    class Updater:
        def get_model(self):
            return model

    model = _first_load(CKPT)
    save_file({"model.embed_tokens.weight": torch.zeros(8, 5)}, str(tmp_path / "model.safetensors"))
    assert weight_check.safetensors_header(tmp_path / "model.safetensors") == {
        "model.embed_tokens.weight": ((8, 5), torch.float32)
    }
    called = []
    ok, msg = weight_check.check_disk_update(
        lambda *a: called.append(a) or (True, "loaded"), Updater(), str(tmp_path), "auto"
    )
    assert not ok and "'model.embed_tokens.weight': shape [8, 5]" in msg and not called
    save_file({k: v for k, v in CKPT.items() if k != "model.embed_tokens.weight"}, str(tmp_path / "model.safetensors"))
    got = weight_check.check_disk_update(lambda *a: (True, "loaded"), Updater(), str(tmp_path), "auto")
    assert got == (True, "loaded")
