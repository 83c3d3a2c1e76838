"""The quality probe on a real SGLang 0.5.23 server (CPU engine, the TRACE plugin's KV methods), one
server per setting (the NVFP4-KV one is a run's rollout server, scored over http), against the
embedded engine on the same checkpoint: the two stacks measure the same damage, and on a checkpoint
with outlier channels planted in K (tests/test_quality.py) SGLang too shows NVFP4 K losing and FP8 K
and de-biased NVFP4 K not."""

from __future__ import annotations

import pytest
import sglang  # noqa: F401 - a missing SGLang fails this module, it is not skipped

from megatron_trace.quality import measure as quality
from tests.helpers import random_prompts

SETTINGS = ["bf16:nvfp4:nvfp4", "bf16:fp8:nvfp4", "bf16:nvfp4+debias:nvfp4"]
SERVED = "bf16:nvfp4:nvfp4"  # scored on the run's rollout server (nvfp4_kv_server)


@pytest.fixture(scope="module")
def nvfp4_kv_server_starting(outlier_ckpt, tmp_path_factory):  # noqa: F811
    """A run's rollout server serving NVFP4 K + NVFP4 V (what the planted K outlier breaks): the
    quality report scores that setting on it, and the gate of an http run below scores it there too.
    A future of its URL: it starts while the SGLang quality backend starts its own servers."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.sglang_server import start_sglang

    gen = start_sglang(outlier_ckpt, tmp_path_factory, "--kv-cache-dtype", "nvfp4", "--guided-layers", "none")
    pool = ThreadPoolExecutor(1)
    url = pool.submit(next, gen)
    try:
        yield url
    finally:
        pool.shutdown(wait=True)
        gen.close()  # stops the server (the generator's finally)


@pytest.fixture(scope="module")
def nvfp4_kv_server(nvfp4_kv_server_starting):
    return nvfp4_kv_server_starting.result()


@pytest.fixture(scope="module")
def reports(outlier_ckpt, nvfp4_kv_server_starting, tmp_path_factory):  # noqa: F811 - the imported fixture
    """Each stack's report of SETTINGS. On SGLang the BF16 reference and two settings get a server
    each from the SGLang backend; the NVFP4-KV one is the running server above (backend "http"),
    which serves exactly what the backend would start for it."""
    settings = [quality.Setting.parse(s) for s in SETTINGS]
    prompts = random_prompts(3)
    work = tmp_path_factory.mktemp("quality_sglang")
    embedded = quality.run(outlier_ckpt, prompts, settings, max_new_tokens=12, backend="embedded")
    started = [s for s in settings if s.name != SERVED]
    sg = quality.run(outlier_ckpt, prompts, started, max_new_tokens=12, backend="sglang", workdir=work)
    served = quality.run(
        outlier_ckpt,
        prompts,
        [quality.Setting.parse(SERVED)],
        max_new_tokens=12,
        backend="http",
        url=nvfp4_kv_server_starting.result(),
        reference=sg,
    )
    assert served["backend"] == "http" and served["settings"][quality.REFERENCE] == sg["settings"][quality.REFERENCE]
    sg["settings"][SERVED] = served["settings"][SERVED]
    return {"sglang": sg, "embedded": embedded}


def test_sglang_and_embedded_measure_the_same_damage(reports):
    sg, emb = reports["sglang"]["settings"], reports["embedded"]["settings"]
    assert reports["sglang"]["backend"] == "sglang"
    for name in [quality.REFERENCE, *SETTINGS]:
        assert sg[name]["tokens"] == emb[name]["tokens"] == 3 * 12, name
        assert sg[name]["kv_bytes_per_token"] == emb[name]["kv_bytes_per_token"], name
        assert abs(sg[name]["nll_per_token"] - emb[name]["nll_per_token"]) < 2e-3, (name, sg[name], emb[name])
        assert abs(sg[name]["top1_agreement"] - emb[name]["top1_agreement"]) <= 1 / 36 + 1e-9, name
    assert sg[quality.REFERENCE]["outputs"] == emb[quality.REFERENCE]["outputs"]


def test_sglang_shows_nvfp4_k_losing_and_fp8_or_debiased_k_not(reports):
    """The planted outliers sit in K's bias: the plugin's de-biased NVFP4 K (plugin/kv_debias.py) takes
    them out as the engine's does, at NVFP4's bytes."""
    inc = {n: r["nll_increase"] for n, r in reports["sglang"]["settings"].items()}
    assert inc[quality.REFERENCE] == 0
    assert inc["bf16:nvfp4:nvfp4"] > 1.0
    assert inc["bf16:fp8:nvfp4"] < inc["bf16:nvfp4:nvfp4"] / 5
    assert inc["bf16:nvfp4+debias:nvfp4"] < inc["bf16:nvfp4:nvfp4"] / 5


def test_targets_are_refused_on_sglang(outlier_ckpt, tmp_path):  # noqa: F811
    with pytest.raises(SystemExit):
        quality.parse_args(
            [
                "--model-path",
                str(outlier_ckpt),
                "--prompts",
                "p.jsonl",
                "--backend",
                "sglang",
                "--targets",
                "*.mlp.down_proj",
            ]
        )


def test_the_gate_of_an_http_run_scores_its_sglang_server(outlier_ckpt, nvfp4_kv_server, reports):  # noqa: F811
    """rollout.backend=http: the run's setting is scored on the rollout server itself (BF16 and the
    candidates on the embedded engine beside it); its loss is what the SGLang quality backend measured,
    and the gate stops naming the cheapest candidate that passes."""
    from megatron_trace.models import QuantPolicy
    from megatron_trace.quality.gate import QualityGateError, gate

    policy = QuantPolicy(format="bf16", weights="bf16", activations="bf16", kv="nvfp4")
    limits = dict(max_nll_increase=0.6, max_accuracy_drop=0.125, max_new_tokens=12, dtype="float32")

    def served_gate(p, accept_loss):
        prompts = random_prompts(3)
        return gate(outlier_ckpt, p, prompts, accept_loss=accept_loss, url=nvfp4_kv_server, log=print, **limits)

    res = served_gate(policy, accept_loss=True)
    measured = reports["sglang"]["settings"]["bf16:nvfp4:nvfp4"]["nll_increase"]
    assert res.report["backend"] == "http" and not res.passed
    assert abs(res.nll_increase - measured) < 2e-3, (res.nll_increase, measured)
    served = rf"served by {nvfp4_kv_server}(.|\n)*cheapest that passes is bf16:nvfp4\+debias"
    with pytest.raises(QualityGateError, match=served):
        served_gate(policy, accept_loss=False)
    debiased = QuantPolicy(format="bf16", weights="bf16", activations="bf16", kv="nvfp4", kv_k_debias=True)
    with pytest.raises(RuntimeError, match="serves .* not the setting"):  # the server does not de-bias K
        served_gate(debiased, accept_loss=True)
