"""The config tree: YAML + overrides, and errors that name the key and what is allowed."""

from pathlib import Path

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


@pytest.mark.parametrize(
    "override,message",
    [
        ("algo.loss=grpo", "algo.loss must be one of ppo_clip, tis, mis, none; got 'grpo'"),
        ("trainer.lr=fast", "trainer.lr must be a number"),
        ("trainer.tp=0", "trainer.tp must be >= 1"),
        ("trainer.steps=2.5", "trainer.steps must be int"),
        ("trainer.bogus=1", "unknown keys ['trainer.bogus']"),
        ("nosuch.key=1", "unknown config sections ['nosuch']"),
        ("quant.kv=fp4", "quant.kv must be one of auto, bf16, fp8, nvfp4, mxfp4"),
        ("quant.kv_k=int8", "quant.kv_k must be one of , bf16, fp8, nvfp4, mxfp4"),
        ("quant.weights=bf16", "quant"),  # W16A4 is not a policy
        ("trainer.lr", "must look like section.key=value"),
    ],
)
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
    for path in Path(__file__).resolve().parents[1].glob("configs/*.yaml"):
        Config.load(path)


def test_sections_built_in_code_are_checked_like_loaded_ones():
    from megatron_trace.config import AlgoConfig, RolloutConfig, TrainerConfig

    assert TrainerConfig(lr=1).lr == 1.0 and isinstance(TrainerConfig(lr=1).lr, float)  # coerced by annotation
    with pytest.raises(ValueError, match="algo.loss must be one of ppo_clip, tis, mis, none; got 'grpo'"):
        AlgoConfig(loss="grpo")
    with pytest.raises(ValueError, match="trainer.micro_batch_size must be >= 1; got 0"):
        TrainerConfig(micro_batch_size=0)
    with pytest.raises(ValueError, match=r"rollout.top_p must be in \(0, 1\]"):
        RolloutConfig(top_p=1.5)
    with pytest.raises(ValueError, match="algo.is_clip must be > 1; got 1.0"):
        Config.load(None, ["algo.is_clip=1"])
    with pytest.raises(ValueError, match="algo.mis_low/mis_high must satisfy 0 < low < 1 < high; got 1.5, 2.0"):
        Config.load(None, ["algo.mis_low=1.5"])


def test_launch_env_is_torchruns_rendezvous_or_none():
    from megatron_trace.config import LaunchEnv

    assert LaunchEnv.from_env({}) is None
    assert LaunchEnv.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == LaunchEnv(1, 2, 1)
    with pytest.raises(ValueError, match="RANK/WORLD_SIZE/LOCAL_RANK are incomplete"):
        LaunchEnv.from_env({"WORLD_SIZE": "2"})


def test_checkpoint_paths_expand_home_and_a_missing_one_is_named(tmp_path, monkeypatch):
    from megatron_trace.run.run import check_checkpoint_dirs

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = Config.load(Path(__file__).resolve().parents[1] / "configs/qwen2.5_0.5b_cpu.yaml", [])
    assert cfg.model.path == str(tmp_path / ".cache/megatron_trace/qwen2.5-coder-0.5b/hf_bf16")
    assert cfg.model.tokenizer == cfg.model.path
    with pytest.raises(
        FileNotFoundError,
        match=r"model.path=.*hf_bf16: no HF checkpoint directory there .*python -m megatron_trace.models.real_qwen",
    ):
        check_checkpoint_dirs(cfg)
    (Path(cfg.model.path)).mkdir(parents=True)
    (Path(cfg.model.path) / "config.json").write_text("{}")
    check_checkpoint_dirs(cfg)  # the tokenizer directory is the same, now there
