"""The config tree: YAML + overrides, and errors that name the key and what is allowed."""
import pytest

from megatron_trace.config import Config


def test_yaml_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  lr: 1.0e-3\n  steps: 5\nalgo:\n  loss: tis\n")
    cfg = Config.load(f, ["trainer.lr=3e-4", "guidance.layers=4", "quant.targets=['*.mlp.*_proj']"])
    assert cfg.trainer.lr == 3e-4 and cfg.trainer.steps == 5 and cfg.algo.loss == "tis"
    assert cfg.guidance.layers == 4 and cfg.quant.targets == ["*.mlp.*_proj"]
    cfg.save(tmp_path / "resolved.yaml")
    assert Config.load(tmp_path / "resolved.yaml").to_dict() == cfg.to_dict()


@pytest.mark.parametrize("override,message", [
    ("algo.loss=grpo", "algo.loss must be one of ppo_clip, tis, mis, none; got 'grpo'"),
    ("trainer.lr=fast", "trainer.lr must be a number"),
    ("trainer.tp=0", "trainer.tp must be >= 1"),
    ("trainer.steps=2.5", "trainer.steps must be int"),
    ("trainer.bogus=1", "unknown keys ['trainer.bogus']"),
    ("nosuch.key=1", "unknown config sections ['nosuch']"),
    ("quant.kv=fp4", "quant.kv must be one of auto, nvfp4, mxfp4, fp8, bf16"),
    ("quant.kv_k=int8", "quant.kv_k must be one of , nvfp4, mxfp4, fp8, bf16"),
    ("quant.weights=bf16", "quant"),  # W16A4 is not a policy
    ("trainer.lr", "must look like section.key=value"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ValueError, match=None) as e:
        Config.load(None, [override])
    assert message in str(e.value)


def test_bad_yaml_files(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("trainer: [1, 2\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        Config.load(f)
    f.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="mapping of sections"):
        Config.load(f)
    f.write_text("trainer: 3\n")
    with pytest.raises(ValueError, match="section 'trainer' must be a mapping"):
        Config.load(f)


def test_shipped_configs_load():
    from pathlib import Path

    for path in Path(__file__).resolve().parents[1].glob("configs/*.yaml"):
        Config.load(path)
