"""Checks of the HTTP rollout servers before the first step: each must serve what the trainer
assumes (its weight version, a de-biased K cache when asked), or the run stops naming the server."""

from __future__ import annotations

from sglang_backend.api import serves_version
from sglang_backend.client import RolloutError


def check_server_versions(client, expected: int) -> None:
    """Before the first rollout every server must serve the trainer's weight version: one still holding
    another run's (or an earlier step's) weights would sample from a policy the trainer never had,
    and the mismatch would only show as a large |logp gap| in the metrics."""
    for url in client.urls:
        served = client.model_info(url).get("weight_version")
        if not serves_version(served, expected):
            raise ValueError(
                f"rollout server {url} serves weight version {served!r}, but the trainer starts at version "
                f"{expected}: it holds other weights than the trainer's (another run's, or a later step's). "
                f"Restart it from the start checkpoint with --weight-version {expected} (python -m "
                "sglang_backend.launch ...), or resume the run that left it there"
            )


def check_debiased_server(client, url: str) -> None:
    """quant.kv_k_debias over HTTP: the trainer quantizes K - RoPE(b), so a server caching plain K
    would leave TRACE guiding the wrong tensor; refuse it before the first step. Both the embedded
    server and SGLang with the plugin answer GET /trace_policy."""
    try:
        served = client.trace_policy(url).get("kv_k_debias")
    except RolloutError as e:
        served = f"unknown: {e}"
    if served is not True:
        raise ValueError(
            f"quant.kv_k_debias=true, but the rollout server {url} does not serve a de-biased K cache "
            f"(its /trace_policy kv_k_debias is {served!r}); start it with python -m sglang_backend.launch "
            "--kv-k-debias (--backend local, or --backend sglang with the trace_fp4 plugin)"
        )
