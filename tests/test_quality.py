"""The quality probe on a random-init Qwen2 with outlier channels planted in K (a large k_proj bias,
as Qwen2.5 has): NVFP4 K loses, FP8 K does not; the CLI writes its table, JSON and PNG."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_trace import quality
from megatron_trace.models import QuantPolicy, make_tiny_checkpoint


@pytest.fixture(scope="module")
def outlier_ckpt(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("outlier_k"), "qwen2", seed=1)
    f = path / "model.safetensors"
    sd = load_file(f)
    for i in range(4):
        # Channel 7 of KV head 0 is RoPE's slowest pair (it barely rotates): a constant +50 there
        # shifts every score of a query equally, so BF16 attention ignores it, but it sets K's amax.
        # (One outlier per token: FP8's per-token scale maps it to 448 exactly. Planted in both heads,
        # the smaller one lands between E4M3 codes 32 apart and FP8 K costs +0.87 here: docs/quality.md.)
        sd[f"model.layers.{i}.self_attn.k_proj.bias"].view(2, 16)[0, 7] += 50.0
        sd[f"model.layers.{i}.self_attn.q_proj.weight"] *= 3.0  # sharper attention: K's content matters
    save_file(sd, f, metadata={"format": "pt"})
    return path


def _prompts(n=4):
    g = torch.Generator().manual_seed(0)
    return [{"ids": torch.randint(3, 320, (12,), generator=g).tolist(), "text": None, "answer": None} for _ in range(n)]


def test_nvfp4_k_loses_and_fp8_k_does_not(outlier_ckpt):
    specs = ["bf16:nvfp4:bf16", "bf16:fp8:bf16", "bf16:nvfp4:nvfp4", "bf16:fp8:nvfp4", "bf16:bf16:nvfp4"]
    rep = quality.run(outlier_ckpt, _prompts(), [quality.Setting.parse(s) for s in specs], max_new_tokens=24)
    inc = {n: r["nll_increase"] for n, r in rep["settings"].items()}
    ref = rep["settings"][quality.REFERENCE]
    assert inc[quality.REFERENCE] == 0 and ref["top1_agreement"] == 1 and ref["same_greedy_answers"] == 1
    assert ref["tokens"] == 4 * 24
    assert inc["bf16:nvfp4:bf16"] > 1.0 and abs(inc["bf16:fp8:bf16"]) < 0.1  # measured +3.06 / +0.009
    assert inc["bf16:nvfp4:nvfp4"] > 1.0  # measured +3.13
    # FP8 K adds (almost) nothing to what NVFP4 V alone costs this random model (+0.220 vs +0.254)
    assert abs(inc["bf16:fp8:nvfp4"] - inc["bf16:bf16:nvfp4"]) < 0.06
    assert inc["bf16:fp8:nvfp4"] < inc["bf16:nvfp4:nvfp4"] / 5
    assert rep["settings"]["bf16:fp8:nvfp4"]["kv_bytes_per_token"] == 4 * 2 * 16 * (8 + 1 + 4.5) / 8  # 2 heads x 16


def test_cli_writes_table_json_png(outlier_ckpt, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p["ids"]}) + "\n" for p in _prompts(2)))
    rc = quality.main(
        [
            "--model-path",
            str(outlier_ckpt),
            "--prompts",
            str(prompts),
            "--settings",
            "bf16:fp8:nvfp4",
            "--max-new-tokens",
            "4",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert rc == 0
    rep = json.loads((tmp_path / "out" / "quality.json").read_text())
    assert list(rep["settings"]) == [quality.REFERENCE, "bf16:fp8:nvfp4"]
    assert (tmp_path / "out" / "quality.png").read_bytes()[:4] == b"\x89PNG"
    assert "| bf16:fp8:nvfp4 |" in capsys.readouterr().out


def test_bad_settings_and_prompts_are_named(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"K must be one of bf16, fp8, nvfp4, mxfp4, fp8\+debias, nvfp4\+debias, "
        r"mxfp4\+debias; got 'fp4'",
    ):
        quality.Setting.parse("w4a4:fp4:nvfp4")
    with pytest.raises(ValueError, match="WEIGHTS:K:V"):
        quality.Setting.parse("w4a4")
    (tmp_path / "p.jsonl").write_text('{"question": "1+1"}\n')
    with pytest.raises(ValueError, match="p.jsonl:1: a prompt line needs 'prompt', 'messages' or 'input_ids'"):
        quality.load_prompts(tmp_path / "p.jsonl", tmp_path)


def test_train_hook_warns_only_above_the_threshold(outlier_ckpt):
    lossy = quality.quality_warning(
        outlier_ckpt,
        QuantPolicy(format="bf16", weights="bf16", activations="bf16", kv="nvfp4"),
        _prompts(2),
        max_new_tokens=8,
    )
    assert lossy is not None and "bf16:nvfp4:nvfp4" in lossy and "in float32 at up to 8 new tokens" in lossy
    assert "Consider quant.kv_k_debias=true" in lossy  # a Qwen2 K bias
    assert (
        quality.quality_warning(
            outlier_ckpt,
            QuantPolicy(format="bf16", weights="bf16", activations="bf16", kv_k="fp8"),
            _prompts(2),
            max_new_tokens=8,
        )
        is None
    )


@pytest.mark.parametrize(
    "text,ok",
    [
        ("17 + 25 equals 42.", 1.0),
        ("42", 1.0),
        ("so \\boxed{42}, not 41", 1.0),
        ("17 + 25 = 8", 0.0),
        ("17+25 equals 422.", 0.0),
        ("no idea", 0.0),
        ("the sum is 1,042.", 0.0),
    ],
)
def test_verifier_reads_the_last_number_when_nothing_is_boxed(text, ok):
    assert quality.verify_answer(text, "42") == ok


class _IdsText:
    """Decodes ids to their numbers: enough text for an exact-match score on synthetic prompts."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_train_hook_warns_on_lost_accuracy_the_nll_hides(outlier_ckpt):
    """With the run's verifier, a greedy-accuracy drop warns even when the NLL threshold would not."""
    tok, prompts = _IdsText(), _prompts(4)
    ref = quality.run(outlier_ckpt, prompts, [], max_new_tokens=8, tokenizer=tok)["settings"][quality.REFERENCE]
    for p, text in zip(prompts, ref["texts"]):
        p["answer"] = text  # BF16's own greedy answers: BF16 scores 100%
    kw = dict(max_new_tokens=8, tokenizer=tok, score=lambda r, a: float(r == a), threshold=1e9)
    lossy = quality.quality_warning(
        outlier_ckpt, QuantPolicy(format="bf16", weights="bf16", activations="bf16", kv="nvfp4"), prompts, **kw
    )
    assert lossy is not None and "greedy accuracy 100.0% -> " in lossy
    assert (
        quality.quality_warning(
            outlier_ckpt, QuantPolicy(format="bf16", weights="bf16", activations="bf16", kv="bf16"), prompts, **kw
        )
        is None
    )
