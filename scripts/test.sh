#!/usr/bin/env bash
# The README's test command: sets up .venv on a fresh machine (torch 2.13.0 CPU first, so pip
# never pulls a CUDA build), installs the project with its test extras and a real SGLang 0.5.23
# (scripts/sglang_cpu/install.sh; tests/test_sglang_real.py runs it) and what the Slurm tests need
# (scripts/slurm_ci/install.sh) and the aarch64 cross compiler (scripts/cross/install.sh), lints the tree
# with ruff (ruff.toml: check and format), runs pytest, then runs the tests marked for the lesser CPUs
# again as those CPUs (MEGATRON_TRACE_CPU_ISA; pytest.ini's markers). Extra arguments go to every pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh --sglang
# The Slurm test cluster's host side (daemons, munge, fake GPU device nodes): root + apt-get, else skipped.
bash scripts/slurm_ci/install.sh
# tests/test_cpu_build.py compiles the C kernels for aarch64 (compile only): root + apt-get, else skipped.
bash scripts/cross/install.sh
# The image's Megatron-Core (Dockerfile MEGATRON_CORE_VERSION; its wheels are Python 3.12 only, the
# package is pure Python) beside the venv's, for tests/test_trainer_packed.py's shipped-version run.
MC=$(sed -n 's/^ARG MEGATRON_CORE_VERSION=//p' Dockerfile)
[ -d ".venv/megatron-core-$MC/megatron/core" ] || .venv/bin/python -m pip install -q --no-deps \
  --target ".venv/megatron-core-$MC" --python-version 3.12 --only-binary=:all: "megatron-core==$MC"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
# The suite on this CPU as it is; then, whatever this CPU is, the marked tests as an AVX2-only x86-64
# CPU (the engine, gate and main-command paths: no AVX-512, no oneDNN bf16, bf16 GEMMs in fp32) and as
# a baseline one (the C kernels' scalar paths). Exit 5 (nothing marked among the given tests) passes.
status=0
lane() {
  local rc=0
  "$@" || rc=$?
  ((rc == 0 || rc == 5)) || status=$rc
}
lane .venv/bin/python -m pytest -q "$@"
if [[ $(uname -m) == x86_64 ]] && grep -qw avx2 /proc/cpuinfo; then
  lane env MEGATRON_TRACE_CPU_ISA=avx2 .venv/bin/python -m pytest -q -m isa_avx2 "$@"
  lane env MEGATRON_TRACE_CPU_ISA=baseline .venv/bin/python -m pytest -q -m isa_baseline "$@"
else
  echo "scripts/test.sh: the avx2 and baseline lanes are x86-64 ones (this is $(uname -m) without AVX2): not run" >&2
fi
exit $status
