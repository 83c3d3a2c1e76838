#!/usr/bin/env bash
# Installs a real SGLang 0.5.23 into .venv for the tests (called by scripts/setup_env.sh --sglang).
# sglang's wheel pins torch==2.14.1 and CUDA-only packages, so it goes in with --no-deps over the
# torch already installed; its pure-Python needs come from requirements.txt beside this file under
# a constraint that holds torch (and transformers) at the installed versions, so pip can never
# swap them. On a CPU-only torch, stand-ins for the two CUDA-only binaries go on the venv's path
# through one .pth: site/sgl_kernel (one torch function, everything else raises when called) and
# site/trace_torchvision_schemas.py (two op schemas torchvision's CUDA build expects).
# Idempotent: a second run only re-checks.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
SGLANG_VERSION=0.5.23
TORCHVISION_VERSION="${TORCHVISION_VERSION:-0.28.0}"  # the release paired with torch 2.13
here=scripts/sglang_cpu
cons="$(mktemp)"
trap 'rm -f "$cons"' EXIT
"$PY" - "$cons" <<'PYEOF'
import sys, importlib.metadata as md
with open(sys.argv[1], "w") as f:
    for name in ("torch", "transformers", "tokenizers", "numpy"):
        try:
            f.write(f"{name}=={md.version(name)}\n")
        except md.PackageNotFoundError:
            pass
PYEOF
"$PY" -m pip install -q -r "$here/requirements.txt" -c "$cons"
have() { "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$2')" 2>/dev/null; }
have sglang "$SGLANG_VERSION" || "$PY" -m pip install -q --no-deps "sglang==$SGLANG_VERSION" -c "$cons"
cpu_torch="$("$PY" -c 'import torch; print(int(torch.version.cuda is None))')"
if [ "$cpu_torch" = 1 ]; then
  have torchvision "$TORCHVISION_VERSION" || "$PY" -m pip install -q --no-deps "torchvision==$TORCHVISION_VERSION" -c "$cons"
  site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  pth="$site/trace_sglang_cpu_stand_ins.pth"
  want="$(printf '%s\nimport trace_torchvision_schemas\n' "$(cd "$here/site" && pwd)")"
  [ -f "$pth" ] && [ "$(cat "$pth")" = "$want" ] || printf '%s\n' "$want" > "$pth"
fi
"$PY" -c "import sglang, torch, torchvision; from sglang.srt.entrypoints import http_server; \
print(f'sglang {sglang.__version__} on torch {torch.__version__}')"
