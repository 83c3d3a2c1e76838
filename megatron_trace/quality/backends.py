"""Where the quality probe runs one quantization setting: the embedded engine or a real SGLang server.

    sc = open_scorer("sglang", model_path, setting, dtype="float32", targets=None, workdir=d)
    outs = sc.greedy(prompts, max_new_tokens)                # token ids per prompt
    nll, top1 = sc.teacher_forced(prompt_ids, continuation)  # per continuation token
    sc.kv_bytes_per_token(); sc.close()

Both answer the same two questions with their own serving numerics: greedy decode, and a
teacher-forced pass over prompt + continuation through the (quantized) KV cache. The embedded
scorer does it in-process (one prefill over the engine's paged KV); the served scorer asks a
running SGLang server's `/generate` for input-token logprobs (`logprob_start_len`,
`top_logprobs_num=1`): a server the SGLang scorer launches for the setting (`python -m
sglang_backend.launch --backend sglang` with its flags), or a run's rollout server ("http").
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from megatron_trace.quality.measure import DEBIASED

BACKENDS = ("embedded", "sglang")  # the CLI's; open_scorer also takes "http" (a running server)
# weights of a setting -> the launcher's --quantization (online quantization inside SGLang)
SGLANG_QUANTIZATION = {"bf16": None, "w4a4": "nvfp4", "w4a16": "w4a16_nvfp4"}


class Scorer(Protocol):
    def greedy(self, prompts: list[dict], max_new_tokens: int) -> list[list[int]]: ...
    def teacher_forced(self, prompt: list[int], continuation: list[int]) -> tuple[list[float], list[bool]]: ...
    def kv_bytes_per_token(self) -> float: ...
    def close(self) -> None: ...


class EmbeddedScorer:
    def __init__(self, model_path, policy, dtype: str, name: str):
        from sglang_backend.local import Engine

        self.name = name
        self.engine = Engine(str(model_path), dtype=dtype, quant_policy=policy, max_total_tokens=1 << 15)

    def greedy(self, prompts: list[dict], max_new_tokens: int) -> list[list[int]]:
        """Greedy answers; an aborted one (an engine error) raises with the engine's message, never scores."""
        from sglang_backend.api import check_answered

        sp = {"temperature": 0, "max_new_tokens": max_new_tokens}
        outs = self.engine.generate(input_ids=[p["ids"] for p in prompts], sampling_params=sp)
        return [o["output_ids"] for o in check_answered(outs, f"{self.name}'s greedy answers (embedded engine)")]

    @torch.inference_mode()
    def teacher_forced(self, prompt: list[int], continuation: list[int]) -> tuple[list[float], list[bool]]:
        """One prefill of prompt + continuation through the engine's model over its own (quantized)
        KV pages; called only while the engine is idle (its worker never touches the cache between
        requests)."""
        from sglang_backend.local.model import ForwardBatch

        if not continuation:
            return [], []
        ids = prompt + continuation
        kv = self.engine.kv
        pages = kv.allocate(kv.pages_needed(len(ids)))
        try:
            slots = kv.slots(pages, 0, len(ids))
            rows = list(range(len(prompt) - 1, len(ids) - 1))  # row i predicts token i + 1
            batch = ForwardBatch(
                torch.tensor(ids), torch.arange(len(ids)), [(0, len(ids))], slots, [slots], logits_rows=rows
            )
            logp = torch.log_softmax(self.engine.model(batch, kv).float(), dim=-1)
        finally:
            kv.release(pages)
        nxt = torch.tensor(continuation)
        nll = (-logp[torch.arange(len(rows)), nxt]).tolist()
        return nll, (logp.argmax(-1) == nxt).tolist()

    def kv_bytes_per_token(self) -> float:
        return self.engine.kv.bytes_per_token()

    def close(self) -> None:
        self.engine.shutdown()


class ServedScorer:
    """A running SGLang server (with the TRACE plugin) that serves one setting: the SGLang scorer's
    own server, or a run's rollout server (the gate of rollout.backend=http). It must report the
    setting's K/V at GET /trace_policy (a de-biased K the plugin dropped would be scored as asked)."""

    def __init__(self, url: str, setting, model_path, dtype: str, *, api_key: str | None = None, server=None):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.server, self.url = server, url
        self.http = httpx.Client(base_url=url, timeout=600, headers=headers)
        self.setting, self.model_path, self.dtype = setting, model_path, dtype
        self._check_served()

    def _check_served(self) -> None:
        from sglang_backend.api import TRACE_POLICY_PATH

        r = self.http.get(TRACE_POLICY_PATH)
        served = r.json() if r.status_code == 200 else {"error": f"GET {TRACE_POLICY_PATH}: {r.status_code}"}
        want_k = self.setting.k.removesuffix(DEBIASED)
        formats = served.get("kv_formats")
        ok = served.get("kv_k_debias") == self.setting.k.endswith(DEBIASED) and (
            formats == ["unknown", "unknown"] or formats == [want_k, self.setting.v]
        )
        if not ok:
            self.close()
            raise RuntimeError(
                f"setting {self.setting.name}: the server at {self.url} serves {served}, not the setting"
            )

    def _log_tail(self) -> str:
        return self.server.log_tail() if self.server is not None else ""

    def _generate(self, body: dict) -> dict:
        # A batch decodes its answers together: its time grows with their length (a CPU server at 1,024
        # tokens takes well over the 600 s that suffice for one short request). 2 s per token bounds a
        # server that stopped making progress without cutting off a slow one.
        import httpx

        read_s = 600 + 2.0 * body.get("sampling_params", {}).get("max_new_tokens", 0)
        r = self.http.post("/generate", json=body, timeout=httpx.Timeout(600, read=read_s))
        if r.status_code != 200:
            raise RuntimeError(f"{self.url}/generate answered {r.status_code}: {r.text[:500]}\n{self._log_tail()}")
        return r.json()

    def greedy(self, prompts: list[dict], max_new_tokens: int) -> list[list[int]]:
        """Greedy answers; an aborted one raises with the server's message, never scores."""
        from sglang_backend.api import check_answered

        sp = {"temperature": 0, "max_new_tokens": max_new_tokens}
        outs = self._generate({"input_ids": [p["ids"] for p in prompts], "sampling_params": sp})
        return [o["output_ids"] for o in check_answered(outs, f"{self.setting.name}'s greedy answers ({self.url})")]

    def teacher_forced(self, prompt: list[int], continuation: list[int]) -> tuple[list[float], list[bool]]:
        """SGLang's input-token logprobs from the last prompt token on: its first entry (that token
        itself) carries none, each later one is log p(token | everything before it)."""
        from sglang_backend.api import check_answered

        if not continuation:
            return [], []
        out = self._generate(
            {
                "input_ids": prompt + continuation,
                "return_logprob": True,
                "top_logprobs_num": 1,
                "logprob_start_len": len(prompt) - 1,
                "sampling_params": {"temperature": 0, "max_new_tokens": 1},
            }
        )
        meta = check_answered([out], f"{self.setting.name}'s teacher-forced pass ({self.url})")[0]["meta_info"]
        scored, tops = meta["input_token_logprobs"][1:], meta["input_top_logprobs"][1:]
        if [t[1] for t in scored] != continuation or len(tops) != len(continuation):
            raise RuntimeError(f"SGLang scored tokens {[t[1] for t in scored]} for the continuation {continuation}")
        return [-t[0] for t in scored], [top[0][1] == tok for top, tok in zip(tops, continuation)]

    def kv_bytes_per_token(self) -> float:
        """The setting's K and V of one token across all layers, as the formats store them."""
        from megatron_trace.models import ModelArch
        from megatron_trace.models.quant_policy import kv_side_bits

        arch = ModelArch.from_hf_config(Path(self.model_path))
        row, wide = arch.num_kv_heads * arch.head_dim, torch.finfo(getattr(torch, self.dtype)).bits
        k_fmt = self.setting.k.removesuffix(DEBIASED)  # de-biasing stores no more than the format
        pair = kv_side_bits(k_fmt, row, wide) + kv_side_bits(self.setting.v, row, wide)
        return arch.num_layers * row * pair / 8

    def close(self) -> None:
        self.http.close()
        if self.server is not None:
            self.server.stop()


def sglang_scorer(model_path, setting, dtype: str, workdir: str | Path, device: str = "cpu") -> ServedScorer:
    """A real SGLang server started for one setting (python -m sglang_backend.launch --backend sglang)."""
    from sglang_backend.server_process import SGLangProcess

    flags = [
        "--dtype",
        dtype,
        "--kv-k",
        setting.k.removesuffix(DEBIASED),
        "--kv-v",
        setting.v,
        "--guided-layers",
        "none",
        "--max-total-tokens",
        "8192",
        "--max-running-requests",
        "16",
    ]
    if setting.k.endswith(DEBIASED):  # K - RoPE_pos(k_proj bias) in the cache (plugin/kv_debias.py)
        flags.append("--kv-k-debias")
    quantization = SGLANG_QUANTIZATION[setting.weights]
    if quantization is not None:
        flags += ["--quantization", quantization]
    log = Path(workdir) / f"sglang-{setting.name.replace(':', '_')}.log"
    server = SGLangProcess(model_path, flags, log_path=log, device=device)
    return ServedScorer(server.url, setting, model_path, dtype, server=server)


def open_scorer(
    backend: str, model_path, setting, *, dtype: str, targets, workdir=None, url=None, api_key=None
) -> Scorer:
    """backend "http": the running server at `url` serves `setting` (its targets are the server's)."""
    if backend == "embedded":
        return EmbeddedScorer(model_path, setting.policy(targets), dtype, setting.name)
    if backend == "http":
        if url is None:
            raise ValueError("the http quality backend scores a running server: pass its url")
        return ServedScorer(url, setting, model_path, dtype, api_key=api_key)
    if backend != "sglang":
        raise ValueError(f"quality backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if targets is not None:
        raise ValueError(
            "--targets is not supported with --backend sglang: the launcher serves the policy's default "
            "FP4 targets (MLP and routed experts)"
        )
    if workdir is None:
        raise ValueError("the sglang quality backend needs a workdir for the server logs")
    return sglang_scorer(model_path, setting, dtype, workdir)
