"""A guided run never degrades to plain QAT in silence: a rollout without guidance stops it, naming
the server; a config whose FP4 sites guidance cannot cover is refused or warned about at start."""

import pytest

from megatron_trace.config import Config
from megatron_trace.data import ArithmeticTask, CharTokenizer, get_reward_fn
from sglang_backend.api import GenerateResult
from tests.helpers import tiny_rollout


class NoGuidanceServer:
    """The rollout side of a stock SGLang without the plugin: tokens and logprobs, no guidance."""

    urls = ["http://127.0.0.1:30999"]

    def generate(self, reqs):
        return [
            GenerateResult(
                f"{r.rid}-{k}", [3, 4], [-0.5, -0.7], {"type": "length", "length": 2}, len(r.input_ids), "default"
            )
            for r in reqs
            for k in range(r.sampling_params.n)
        ]


def _rollout(*overrides):
    cfg = Config.load("configs/tiny_cpu.yaml", ["rollout.prompts_per_step=2", "rollout.n_samples=2", *overrides])
    tok = CharTokenizer()
    return tiny_rollout(cfg, NoGuidanceServer(), tok, ArithmeticTask(tokenizer=tok), get_reward_fn("exact_match"))


def test_guided_run_without_guidance_stops_naming_the_server():
    with pytest.raises(RuntimeError, match=r"qat_mode=guided.*127\.0\.0\.1:30999.*no guidance handle"):
        _rollout().run(step=0, version=0)
    batch = _rollout("trainer.qat_mode=rtn").run(step=0, version=0)  # plain QAT asked for: fine
    assert [s.guidance for s in batch.samples] == [None] * 4 and [s.version for s in batch.samples] == [0] * 4


def test_guided_config_with_nothing_to_guide_is_refused(capsys):
    with pytest.raises(ValueError, match="nothing to guide.*quant.format=bf16.*K=bf16, V=bf16"):
        _rollout(
            "quant.format=bf16", "quant.weights=bf16", "quant.activations=bf16", "quant.kv_k=bf16", "quant.kv_v=bf16"
        )
    _rollout("quant.format=mxfp4", "quant.kv=mxfp4")  # MXFP4 activations and K/V are guided sites too
    _rollout(  # and so is an FP8 K cache alone
        "quant.format=bf16", "quant.weights=bf16", "quant.activations=bf16", "quant.kv_k=fp8", "quant.kv_v=bf16"
    )
    assert "WARNING" not in capsys.readouterr().out
