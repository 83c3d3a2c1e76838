#!/usr/bin/env bash
# What tests/test_slurm.py's one-node Slurm cluster needs from this host, installed by the test command
# (scripts/test.sh) rather than by a test: Slurm's daemons and munge (apt), and eight fake GPU device
# nodes for its gres.conf (char devices, /dev/null's numbers). Needs root and apt-get; without them
# it says so and changes nothing, and the Slurm tests skip naming this script. Idempotent.
set -euo pipefail
DEV_DIR="${TRACE_SLURM_DEV_DIR:-/var/lib/megatron-trace/slurm-dev}"
if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
  echo "scripts/slurm_ci/install.sh: needs root and apt-get; the Slurm tests will skip" >&2
  exit 0
fi
missing=0
for d in slurmctld slurmd sbatch scontrol munged; do
  command -v "$d" >/dev/null || missing=1
done
if ((missing)); then
  pkgs=(slurmctld slurmd slurm-client munge)
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1; then
    apt-get update -qq >/dev/null 2>&1 || true  # a stale package index: refresh once
    apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1 ||
      echo "scripts/slurm_ci/install.sh: apt-get could not install ${pkgs[*]}; the Slurm tests will skip" >&2
  fi
fi
mkdir -p "$DEV_DIR"
for i in 0 1 2 3 4 5 6 7; do
  [[ -c "$DEV_DIR/nvidia$i" ]] || mknod -m 666 "$DEV_DIR/nvidia$i" c 1 3
done
