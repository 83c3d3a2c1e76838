"""One typed config tree for a run, loaded from YAML and overridden as `section.key=value`.

    configs/tiny_cpu.yaml ──► Config.load(path, ["algo.loss=tis", "trainer.lr=3e-4"]) ──► validated tree
Every field has a default and a one-line help; unknown sections/keys, wrong types and values
outside the allowed set are errors that name the key and what is allowed. The checks are the
sections' own declarations: a section's constructor coerces and checks each field by its
annotation and `opt(...)` metadata (one validator, fields.coerce), then runs the section's cross-field
`check`, so a section built in code (`AlgoConfig(loss="tis")`) is as valid as a loaded one. The
trainer, the loss and the actor read these sections directly.

Nothing else of the trainer side reads argv or environment variables: the one environment it
reads, torchrun's rendezvous, is `LaunchEnv` below. (The SGLang plugin runs in SGLang's processes
without this tree; its settings are `sglang_backend/plugin_settings.py`.)
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from megatron_trace.fields import Raw, Section, build, hints_of, opt
from megatron_trace.models import QuantPolicy


@dataclass
class ModelConfig(Section):
    SECTION: ClassVar[str] = "model"
    path: str = opt("", "HF checkpoint dir; empty builds the tiny model below (embedded default)")
    family: str = opt("qwen2", "tiny model family", ("qwen2", "qwen3", "qwen3_moe"))
    tiny: dict = opt({}, "overrides of the tiny HF config (hidden_size, num_hidden_layers, ...)")
    tokenizer: str = opt("char", "'char' (the arithmetic task's tokenizer) or an HF tokenizer dir")

    def check(self) -> None:
        # Shipped configs name checkpoints under ~/.cache; a YAML string is never shell-expanded.
        self.path = os.path.expanduser(self.path) if self.path else ""
        if self.tokenizer != "char":
            self.tokenizer = os.path.expanduser(self.tokenizer)


def _quant_policy_fields() -> list[tuple]:
    """The `quant` section's policy keys, generated from QuantPolicy's own declarations (default,
    help, allowed values): the policy is declared once. targets is a YAML list here, a tuple there."""
    hints, out = typing.get_type_hints(QuantPolicy), []
    for f in dataclasses.fields(QuantPolicy):
        m = f.metadata
        if f.name == "targets":
            out.append((f.name, list, opt(list(f.default), m["help"])))
        else:
            out.append((f.name, hints[f.name], opt(f.default, m["help"], m["choices"], m["low"])))
    return out


# The rollout-quality gate (quality_gate.py): before step 0, on the run's eval prompts at its answer
# length and dtype. 0.05 nats/token is what de-biased FP8 K + NVFP4 V + W4A4 may cost a real Qwen2.5
# in bf16 (issue check); 2 of 16 greedy answers may flip under any perturbation, 3 may not.
_QUANT_RUN_FIELDS = [
    ("calib_prompts", int, opt(16, "training prompts that calibrate static activation scales", low=1)),
    (
        "quality_gate",
        bool,
        opt(True, "score the rollout's quantization against BF16 before step 0 (rollout.backend=http: on its server)"),
    ),
    ("quality_prompts", int, opt(16, "eval prompts the gate decodes (greedy, rollout.max_new_tokens)", low=1)),
    ("max_nll_increase", float, opt(0.05, "gate: NLL per token over BF16 allowed (nats)", low=0.0)),
    ("max_accuracy_drop", float, opt(0.125, "gate: greedy accuracy lost against BF16 allowed (fraction)", low=0.0)),
    ("accept_quality_loss", bool, opt(False, "run although the gate fails; the loss is logged under quality/*")),
    ("quality_after", bool, opt(True, "after training, the gate's measurement again on the trained weights")),
]


def _spec(self) -> QuantPolicy:
    """The policy as the config writes it (kv may say "auto"); only `resolve` makes one that runs."""
    return QuantPolicy(**{f.name: getattr(self, f.name) for f in dataclasses.fields(QuantPolicy)})


def _resolve(self, arch) -> QuantPolicy:
    """The run's policy on `arch` (the loaded checkpoint's): what Run hands every part that quantizes."""
    return self.spec().resolve(arch)


def _check_policy(self) -> None:
    self.spec()  # the policy's own cross-field rules (W16A4 is not a policy, ...)


# quant: QuantPolicy's keys, then the run's (what the gate and calibration do with it).
QuantConfig = dataclasses.make_dataclass(
    "QuantConfig",
    _quant_policy_fields() + _QUANT_RUN_FIELDS,
    bases=(Section,),
    namespace={
        "SECTION": "quant",
        "RUN_KEYS": tuple(name for name, _, _ in _QUANT_RUN_FIELDS),
        "spec": _spec,
        "resolve": _resolve,
        "check": _check_policy,
    },
)
QuantConfig.__module__, QuantConfig.__qualname__ = __name__, "QuantConfig"


@dataclass
class GuidanceConfig(Section):
    SECTION: ClassVar[str] = "guidance"
    mode: str = opt("mantissa", "what the rollout records per element", ("full", "mantissa"))
    layers: Any = opt("last_half", "guided layers: last_half | all | none | N (last N) | [indices]")
    memory_budget_mb: float = opt(256.0, "host memory for guidance before spilling to disk", low=0)
    spill_dir: str = opt("", "spill directory (default: <run_dir>/guidance_spill)")


@dataclass
class RolloutConfig(Section):
    SECTION: ClassVar[str] = "rollout"
    backend: str = opt("local", "local (embedded, in-process) or http (servers below)", ("local", "http"))
    urls: list = opt([], "rollout server URLs for backend=http")
    api_key: str = opt("", "bearer key of the rollout servers")
    dtype: str = opt("bfloat16", "engine compute dtype", ("bfloat16", "float32"))
    prompts: str = opt(
        "arithmetic",
        "a built-in task ('arithmetic': single digits; 'long_addition': two-digit "
        "addition with a worked answer; 'word_problems': generated multi-step problems answered in "
        "\\boxed{}, for a real model with rollout.reward=math; 'code_tasks': generated function-writing "
        "problems with hidden tests, for rollout.reward=code) or a JSONL path with prompt/answer (or "
        "HumanEval's rows: prompt, test, entry_point)",
    )
    reward: str = opt(
        "exact_match",
        "reward function (code: the answer's program against the task's tests, in the sandbox)",
        ("exact_match", "final_answer", "math", "code"),
    )
    code_sandbox: str = opt(
        "bwrap",
        "rollout.reward=code's isolation: bwrap (namespaces: no host files, no network; the setup installs "
        "bubblewrap) or rlimits (resource limits only: a weaker opt-in every step's log names)",
        ("bwrap", "rlimits"),
    )
    code_workers: int = opt(4, "rollout.reward=code: answers run at once", low=1)
    code_timeout_s: float = opt(10.0, "rollout.reward=code: wall-clock limit of one answer's run (s)", low=0.1)
    humaneval_problems: int = opt(
        164, "rollout.reward=code: HumanEval problems scored greedy before and after training (0: none)", low=0
    )
    prompts_per_step: int = opt(8, "prompts per RL step", low=1)
    n_samples: int = opt(4, "samples per prompt (the GRPO group)", low=1)
    temperature: float = opt(1.0, "sampling temperature (> 0; evaluation is greedy on its own)", low=0)
    top_p: float = opt(1.0, "nucleus sampling mass in (0, 1]; logprobs are those of the filtered distribution", low=0)
    top_k: int = opt(
        -1, "top-k sampling (-1: all); real SGLang reports filtered logprobs only for top_k <= 4096", low=-1
    )
    max_new_tokens: int = opt(8, "response length cap", low=1)
    max_prompt_len: int = opt(256, "longer prompts are rejected or truncated (counted)", low=1)
    long_prompts: str = opt("reject", "what to do with prompts over max_prompt_len", ("reject", "truncate"))
    max_running: int = opt(64, "engine batch capacity", low=1)
    colocated: str = opt(
        "auto",
        "the rollout engine frees its KV pool and weights while the trainer trains (SGLang's "
        "release/resume_memory_occupation; the weight sync refills them): auto = the embedded engine "
        "(backend=local) in sync mode; on = also http servers on the trainer's machine; off = never",
        ("auto", "on", "off"),
    )
    max_total_tokens: int = opt(65536, "token slots of the embedded engine's paged KV pool", low=16)
    eval_prompts: int = opt(32, "prompts of the eval split (never trained on) scored at eval", low=0)
    eval_fraction: float = opt(0.1, "share of the distinct problems / JSONL lines held out as the eval split", low=0)

    def check(self) -> None:
        if self.temperature == 0:
            raise ValueError(
                "rollout.temperature must be > 0; got 0 (greedy): a GRPO group of greedy answers is "
                "identical, so every advantage is 0, and the trainer recomputes a sampling policy. "
                "Evaluation is greedy already (eval/accuracy)"
            )
        if not self.eval_fraction < 1:
            raise ValueError(f"rollout.eval_fraction must be in [0, 1); got {self.eval_fraction!r}")
        if self.top_k == 0:
            raise ValueError("rollout.top_k must be -1 (all tokens) or >= 1; got 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1]; got {self.top_p!r}")


@dataclass
class TrainerConfig(Section):
    SECTION: ClassVar[str] = "trainer"
    tp: int = opt(1, "tensor parallel size", low=1)
    pp: int = opt(1, "pipeline parallel size", low=1)
    ep: int = opt(1, "expert parallel size (MoE; allgather dispatcher, so CPU/gloo works too)", low=1)
    routing_replay: str = opt(
        "auto",
        "MoE routing replay (R3): the trainer's routers take the rollout's experts; auto = on for MoE models",
        ("auto", "on", "off"),
    )
    lr: float = opt(1e-4, "Adam learning rate", low=0)
    lr_warmup_steps: int = opt(
        0, "linear LR warmup from lr/N over the first N optimizer steps (Megatron's OptimizerParamScheduler)", low=0
    )
    clip_grad: float = opt(1.0, "global grad-norm clip", low=0)
    weight_decay: float = opt(0.0, "Adam weight decay", low=0)
    cp: int = opt(1, "context parallel size: each packed sample split in 2*cp zigzag chunks (gloo too)", low=1)
    packing: bool = opt(
        True, "pack samples into THD token streams by token budget; false: micro_batch_size right-padded rows"
    )
    max_tokens_per_microbatch: int = opt(
        8192, "packed train micro-batch token budget per rank before CP split (a longer sample runs alone)", low=1
    )
    max_tokens_per_logprob_microbatch: int = opt(16384, "packed token budget of forward-only logprob recompute", low=1)
    micro_batch_size: int = opt(8, "sequences per micro-batch of the padded layout (trainer.packing=false)", low=1)
    logprob_chunk_mb: float = opt(128.0, "fp32 logits held at once by the chunked vocab-parallel logprobs (MiB)", low=1)
    logprob_keep_logits_mb: float = opt(
        0.0,
        "a micro-batch's LM-head logits (in the weights' dtype) kept from the forward for its backward when "
        "they fit in this many MiB, one of the head's four GEMMs saved; 0: the backward recomputes them",
        low=0,
    )
    memory_check: bool = opt(True, "refuse a plan whose trainer memory estimate does not fit this machine")
    memory_budget_gib: float = opt(
        0.0,
        "refuse, before step 0, a one-process plan (embedded engine + trainer) whose predicted peak "
        "exceeds this many GiB (perf.memory's table); 0: no budget",
        low=0,
    )
    recompute: str = opt(
        "none",
        "activation recompute: none, selective (Megatron's core_attn + dense mlp modules), full (every layer)",
        ("none", "selective", "full"),
    )
    qat_mode: str = opt(
        "guided", "trainer forward: off (BF16), rtn (plain QAT), guided (TRACE)", ("off", "rtn", "guided")
    )
    dtype: str = opt("float32", "trainer params dtype (float32 on CPU)", ("float32", "bfloat16"))
    sequence_parallel: bool = opt(False, "Megatron sequence parallelism (needs tp > 1; CPU/gloo too)")
    distributed_optimizer: bool = opt(False, "GPU/TE only: shard optimizer state across data-parallel ranks")
    optimizer_offload: str = opt(
        "none",
        "disk: Adam's moments live in a file in the run dir between optimizer steps (O_DIRECT; "
        "bit-identical, a write and a read of their size each step); none: resident",
        ("none", "disk"),
    )
    optimizer_offload_window_mb: float = opt(
        512.0,
        "optimizer_offload=disk: the most moment bytes in memory at once while the optimizer step streams "
        "them from the file and back (one parameter's at least)",
        low=1,
    )
    optimizer_offload_keep_mb: float = opt(
        0.0,
        "optimizer_offload=disk: this many MiB of moments stay in memory (the first parameters' in stepping "
        "order, whole): that much less disk traffic a step for that much more resident",
        low=0,
    )
    steps: int = opt(20, "RL steps", low=0)
    save_every: int = opt(10, "checkpoint every N steps (0: only at the end)", low=0)
    keep_checkpoints: int = opt(0, "keep the newest N checkpoints, deleting older ones after each save (0: all)", low=0)
    warm_start_steps: int = opt(0, "supervised steps on the task before RL (cached by config)", low=0)
    warm_start_lr: float = opt(3e-3, "learning rate of the warm start", low=0)
    seed: int = opt(0, "seed of data order, sampling and init")


@dataclass
class AlgoConfig(Section):
    SECTION: ClassVar[str] = "algo"
    loss: str = opt("ppo_clip", "policy loss", ("ppo_clip", "tis", "mis", "none"))
    is_clip: float = opt(5.0, "token-level importance-ratio clip (dual clip), as in TRACE", low=1)
    eps_low: float = opt(0.2, "PPO clip below 1", low=0)
    eps_high: float = opt(0.28, "PPO clip above 1", low=0)
    tis_cap: float = opt(2.0, "TIS truncation", low=0)
    mis_low: float = opt(0.5, "MIS/IcePop lower ratio bound", low=0)
    mis_high: float = opt(2.0, "MIS/IcePop upper ratio bound", low=1)
    async_rollout: bool = opt(False, "overlap rollout of step k+1 with training of step k")
    max_version_diff: int = opt(1, "drop samples older than this many weight versions (async)", low=0)

    def check(self) -> None:
        if not self.is_clip > 1:
            raise ValueError(f"algo.is_clip must be > 1; got {self.is_clip}")
        if not 0 < self.mis_low < 1 < self.mis_high:
            raise ValueError(
                f"algo.mis_low/mis_high must satisfy 0 < low < 1 < high; got {self.mis_low}, {self.mis_high}"
            )


@dataclass
class TransferConfig(Section):
    SECTION: ClassVar[str] = "transfer"
    transport: str = opt("inprocess", "weight sync path", ("inprocess", "http", "distributed", "disk"))
    bucket_mb: float = opt(64.0, "bucket byte budget", low=0)
    master_address: str = opt(
        "127.0.0.1", "distributed transport: the sending trainer's host as servers reach it ('auto': its hostname)"
    )
    master_port: int = opt(29600, "distributed transport: port of the weight-update group's store", low=1)
    group_backend: str = opt("gloo", "distributed transport: nccl on GPU clusters, gloo elsewhere", ("gloo", "nccl"))


@dataclass
class ClusterConfig(Section):
    SECTION: ClassVar[str] = "cluster"
    trainer_nodes: int = opt(1, "nodes running Megatron", low=1)
    rollout_nodes: int = opt(0, "nodes running SGLang servers", low=0)
    gpus_per_node: int = opt(0, "0 on CPU", low=0)
    sglang_tp: int = opt(1, "tensor parallel size of each SGLang server", low=1)
    gpu: str = opt(
        "", "GPU the trainer memory plan is checked against (perf_memory); empty: none", ("", "h200", "b200", "gb200")
    )


@dataclass
class LoggingConfig(Section):
    SECTION: ClassVar[str] = "logging"
    run_dir: str = opt("runs/tiny_cpu", "where logs, TensorBoard events and checkpoints go")
    tensorboard: bool = opt(True, "write TensorBoard event files")
    progress: bool = opt(True, "show a progress bar")
    samples_per_step: int = opt(
        4, "readable rollouts per step and eval answers per eval (TensorBoard text, samples.jsonl)", low=0
    )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    guidance: GuidanceConfig = field(default_factory=GuidanceConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] = ()) -> Config:
        raw: dict = {}
        if path is not None:
            text = Path(path).read_text()
            try:
                raw = yaml.safe_load(text) or {}
            except yaml.YAMLError as e:
                raise ValueError(f"{path}: not valid YAML: {e}") from None
            if not isinstance(raw, dict):
                raise ValueError(f"{path}: the top level must be a mapping of sections")
        for item in overrides:
            key, sep, value = item.partition("=")
            if not sep or "." not in key:
                raise ValueError(f"override {item!r} must look like section.key=value")
            section, name = key.split(".", 1)
            raw.setdefault(section, {})
            if not isinstance(raw[section], dict):
                raise ValueError(f"config section {section!r} must be a mapping")
            raw[section][name] = Raw(value)  # typed once the field's type is known
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> Config:
        sections = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(sections))
        if unknown:
            raise ValueError(f"unknown config sections {unknown}; allowed: {sorted(sections)}")
        hints = hints_of(cls)
        return cls(**{name: build(name, hints[name], raw.get(name) or {}) for name in sections})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def with_policy(self, policy: QuantPolicy) -> Config:
        """This config with its `quant` keys set to a resolved policy's: what the run saves as its
        config.yaml, so the file says what ran ("auto" resolved) and reloads to the same run."""
        quant = dataclasses.replace(self.quant, **{**policy.to_dict()})
        return dataclasses.replace(self, quant=quant)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def parse_cli(ap, argv=None):
    """Add --config and the section.key=value overrides to `ap`, parse, load: (cfg, args).
    A bad file or value exits through `ap.error` with the message naming the key."""
    ap.add_argument("--config", default=None, help="YAML run config (configs/*.yaml)")
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    args = ap.parse_args(argv)
    try:
        return Config.load(args.config, args.overrides), args
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))


def describe() -> str:
    """Every key with its default and help, for --help."""
    lines = []
    for sec in dataclasses.fields(Config):
        for f in dataclasses.fields(typing.get_type_hints(Config)[sec.name]):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            choices = f" [{'|'.join(map(str, f.metadata['choices']))}]" if f.metadata.get("choices") else ""
            lines.append(f"  {sec.name}.{f.name}={default!r}{choices}  {f.metadata.get('help', '')}")
    return "\n".join(lines)


@dataclass(frozen=True)
class LaunchEnv:
    """Where torchrun (or srun + torchrun) put this trainer process: RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE (the ranks on this host).
    The one environment the trainer side reads (MASTER_ADDR/MASTER_PORT are torch's own, read by
    its env:// rendezvous). `from_env` is None outside such a launcher: a single-process world."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int = 1

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> LaunchEnv | None:
        if "WORLD_SIZE" not in environ:
            return None
        try:
            return cls(
                int(environ["RANK"]),
                int(environ["WORLD_SIZE"]),
                int(environ.get("LOCAL_RANK", 0)),
                int(environ.get("LOCAL_WORLD_SIZE", 1)),
            )
        except (KeyError, ValueError) as e:
            raise ValueError(
                f"WORLD_SIZE is set, so this is a torchrun launch, but RANK/WORLD_SIZE/LOCAL_RANK "
                f"are incomplete or not integers: {e!r}"
            ) from None
