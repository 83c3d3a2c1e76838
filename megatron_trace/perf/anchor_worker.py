"""A timing worker for one anchor (llama.cpp or vLLM-CPU), run in that anchor's own interpreter.

    /tmp/anchors/bin/python megatron_trace/bench/anchor_worker.py llama_cpp --model Q4_K_M.gguf --threads 2 \
        --max-batch 32
    /tmp/vllm/bin/python megatron_trace/bench/anchor_worker.py vllm --model HF_DIR --threads 2 --max-batch 32

megatron_trace/bench/anchors.py starts it as a subprocess; it never imports this project (the anchors live
in venvs of their own). It loads the model once, prints one JSON line {"ready": ...}, then answers
each JSON line {"prompts": [[token ids]], "new_tokens": N} on stdin with {"ids": [[N ids per
prompt]], "seconds": wall time of that generate} on stdout: greedy, EOS off, every prompt in one
batch. The reply waits `settle_s` after the timed call (vLLM's worker spins on its shared-memory
queue for a second after each step: replying at once would have it steal a core from whatever the
benchmark times next). Anything else the library prints goes to stderr, so stdout carries only the
protocol. Errors are answered as {"error": "..."}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback


class LlamaCppRunner:
    """Batched greedy generation on llama.cpp's C API (llama-cpp-python's low-level binding): the
    high-level `Llama` object decodes one sequence, so batch B is B sequence ids in one
    llama_batch per step: one prefill batch of all prompt tokens, then one token per sequence."""

    settle_s = 0.0

    def __init__(self, model: str, threads: int, max_batch: int, max_tokens_per_seq: int):
        import llama_cpp as ll

        self.ll = ll
        ll.llama_backend_init()
        mp = ll.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = ll.llama_model_load_from_file(model.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model}")
        cp = ll.llama_context_default_params()
        cp.n_seq_max = max_batch
        cp.kv_unified = False  # one KV stream per sequence: independent prompts share no prefix
        cp.n_ctx = max_batch * max_tokens_per_seq
        cp.n_batch = cp.n_ubatch = max(512, max_batch * max_tokens_per_seq)
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = ll.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.max_batch, self.n_batch = max_batch, cp.n_batch
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.sampler = ll.llama_sampler_init_greedy()
        self.info = dict(
            library=f"llama-cpp-python {getattr(ll, '__version__', '?')}",
            n_ctx=cp.n_ctx,
            n_seq_max=max_batch,
            kv_unified=False,
            threads=threads,
            n_vocab=self.n_vocab,
        )

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        ll = self.ll
        if len(prompts) > self.max_batch:
            raise ValueError(f"{len(prompts)} prompts > --max-batch {self.max_batch}")
        ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)
        entries = [(s, pos, tok, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        last_index = self._decode(entries)  # prefill: every prompt token, logits at each prompt's last
        out = [[] for _ in prompts]
        for step in range(new_tokens):
            toks = [ll.llama_sampler_sample(self.sampler, self.ctx, last_index[s]) for s in range(len(prompts))]
            for s, t in enumerate(toks):
                out[s].append(int(t))
            if step + 1 < new_tokens:
                last_index = self._decode([(s, len(prompts[s]) + step, t, True) for s, t in enumerate(toks)])
        return out

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> dict[int, int]:
        """llama_decode one batch of (seq id, position, token, wants logits); returns seq -> batch
        index of its logits row."""
        ll = self.ll
        if len(entries) > self.n_batch:
            raise ValueError(f"{len(entries)} tokens in one batch > n_batch {self.n_batch}")
        batch = ll.llama_batch_init(len(entries), 0, 1)
        try:
            index = {}
            for i, (seq, pos, tok, logits) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, logits
                if logits:
                    index[seq] = i
            batch.n_tokens = len(entries)
            rc = ll.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            return index
        finally:
            ll.llama_batch_free(batch)


class VllmRunner:
    """vLLM's offline `LLM.generate` on token-id prompts (bf16, greedy, ignore_eos, no detokenizing)."""

    settle_s = 1.2  # > shm_broadcast.SpinCondition's busy_loop_s (1 s)

    def __init__(self, model: str, threads: int, max_batch: int, max_tokens_per_seq: int):
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        import vllm

        self.vllm = vllm
        self.llm = vllm.LLM(
            model=model,
            dtype="bfloat16",
            max_num_seqs=max_batch,
            max_model_len=max_tokens_per_seq,
            enforce_eager=False,
            seed=0,
            skip_tokenizer_init=True,  # token ids in and out: a checkpoint without a tokenizer runs too
        )
        self.info = dict(
            library=f"vllm {vllm.__version__}",
            threads_bind=os.environ["VLLM_CPU_OMP_THREADS_BIND"],
            kvcache_gib=os.environ["VLLM_CPU_KVCACHE_SPACE"],
        )

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        sp = self.vllm.SamplingParams(
            temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, detokenize=False
        )
        reqs = [{"prompt_token_ids": p} for p in prompts]
        outs = self.llm.generate(reqs, sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


RUNNERS = {"llama_cpp": LlamaCppRunner, "vllm": VllmRunner}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("backend", choices=sorted(RUNNERS))
    ap.add_argument("--model", required=True, help="a GGUF file (llama_cpp) or an HF checkpoint dir (vllm)")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--max-batch", type=int, required=True)
    ap.add_argument("--max-tokens-per-seq", type=int, required=True, help="prompt + new tokens, at most")
    args = ap.parse_args()
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the library's prints (C ones too) go to stderr
    try:
        runner = RUNNERS[args.backend](args.model, args.threads, args.max_batch, args.max_tokens_per_seq)
    except Exception as e:  # reported to the benchmark, which names the anchor as not timed
        protocol.write(json.dumps({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}) + "\n")
        return 1
    protocol.write(json.dumps({"ready": runner.info}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        try:
            t0 = time.perf_counter()
            ids = runner.generate(req["prompts"], int(req["new_tokens"]))
            reply = {"ids": ids, "seconds": time.perf_counter() - t0}
            time.sleep(runner.settle_s)
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        protocol.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
