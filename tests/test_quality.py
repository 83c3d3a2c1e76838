"""The quality probe on a random-init Qwen2 with outlier channels planted in K (a large k_proj bias,
as Qwen2.5 has): NVFP4 K loses, FP8 K does not; the CLI writes its table, JSON and PNG."""

import json

import pytest

from megatron_trace.quality import measure as quality
from tests.helpers import random_prompts


def test_nvfp4_k_loses_and_fp8_k_does_not(outlier_ckpt):
    specs = ["bf16:nvfp4:bf16", "bf16:fp8:bf16", "bf16:nvfp4:nvfp4", "bf16:fp8:nvfp4", "bf16:bf16:nvfp4"]
    rep = quality.run(outlier_ckpt, random_prompts(), [quality.Setting.parse(s) for s in specs], max_new_tokens=24)
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
    # by answer position: buckets 0-8, 8-16, 16-32 of the 24 tokens, each weighted by its 8 tokens per answer
    for r in rep["settings"].values():
        by_pos = r["nll_increase_by_position"]
        assert list(by_pos) == ["0_8", "8_16", "16_32"]
        assert sum(by_pos.values()) / 3 == pytest.approx(r["nll_increase"], abs=1e-9)
    assert rep["settings"]["bf16:nvfp4:bf16"]["nll_increase_by_position"]["16_32"] > 1.0


def test_cli_writes_table_json_png(outlier_ckpt, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p["ids"]}) + "\n" for p in random_prompts(2)))
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
    out = capsys.readouterr().out
    assert "| bf16:fp8:nvfp4 |" in out and "| weights:K:V | 0-8 |" in out  # the table, then by position


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
    with pytest.raises(ValueError, match=r"p.jsonl:1: a prompt line is a list of token ids, .*got \['question'\]"):
        quality.load_prompts(tmp_path / "p.jsonl", tmp_path)


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
