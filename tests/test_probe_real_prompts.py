"""The probe on a user's prompts and a real checkpoint shape: Qwen2.5-0.5B's config (151,936-token
vocabulary, tied embeddings, bf16 weights; 2 of its 24 layers to fit the suite), chat prompts
through the checkpoint's own chat template, and the gap by response position out to the
longest answer, as numbers and as a PNG."""

import json

import pytest

from megatron_trace.models.tiny import make_tiny_checkpoint
from megatron_trace.quality.probe import main

QWEN25_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "num_hidden_layers": 2,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def _chat_tokenizer(out):
    """A small word-level tokenizer with a Qwen-style chat template, saved beside the weights."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = [
        "<unk>",
        "<|im_end|>",
        "<|im_start|>",
        "user",
        "assistant",
        "system",
        "what",
        "is",
        "two",
        "plus",
        "three",
        "?",
        "write",
        "a",
        "poem",
        "about",
        "rain",
        ".",
    ]
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", eos_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)


@pytest.fixture(scope="module")
def qwen25_shape(tmp_path_factory):
    out = make_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen25") / "ckpt", "qwen2", seed=0, dtype="bfloat16", **QWEN25_05B
    )
    _chat_tokenizer(out)
    return out


def test_probe_on_chat_prompts_of_a_real_shape_checkpoint(qwen25_shape, tmp_path, capsys):
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps({"messages": [{"role": "user", "content": c}]})
            for c in ["what is two plus three ?", "write a poem about rain .", "what is rain ?"]
        )
        + "\n"
    )
    out_json, png = tmp_path / "probe.json", tmp_path / "by_position.png"
    assert (
        main(
            [
                "--model-path",
                str(qwen25_shape),
                "--prompts",
                str(prompts),
                "--max-new-tokens",
                "12",
                "--kv-cache-dtype",
                "nvfp4",
                "--micro-batch-size",
                "3",
                "--json",
                str(out_json),
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    res = json.loads(out_json.read_text())
    assert res["num_prompts"] == 3 and res["prompts"] == str(prompts)
    m = res["modes"]
    # Guided is an order of magnitude closer than either unguided mode. rtn vs off is not asserted:
    # on 2 random layers and 36 tokens their order flips with the thread count (the full 24-layer
    # run in BENCHMARKS.md orders guided 0.017 < rtn 0.47 < off 0.65).
    guided = m["guided-full"]["mean_abs_dlogp"]
    assert guided < 0.1 * m["rtn"]["mean_abs_dlogp"] and guided < 0.1 * m["off"]["mean_abs_dlogp"]
    assert min(m["guided-full"]["agreement"].values()) > max(m["rtn"]["agreement"].values())
    longest = max(res["response_lengths"])
    assert all(len(v["dlogp_by_position"]) == longest for v in m.values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "3 prompts (" in capsys.readouterr().out
