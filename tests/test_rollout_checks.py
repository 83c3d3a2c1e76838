"""Before the first step the trainer checks what every HTTP rollout server serves: a server left at
another weight version (another run's weights, or a later step's) stops the run by name instead of
sampling from a policy the trainer never had. Real embedded server, real client."""

import json
import urllib.request

import pytest

from megatron_trace.config import Config
from megatron_trace.models import ModelArch, QuantPolicy, make_tiny_checkpoint
from megatron_trace.run.run import check_server_versions, rollout_backend
from sglang_backend.client import RolloutClient
from sglang_backend.local import Engine
from sglang_backend.local.server import serve

KEY = "k"


def _set_version(url: str, v: str) -> None:
    req = urllib.request.Request(
        url + "/update_weight_version",
        data=json.dumps({"new_version": v}).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    urllib.request.urlopen(req, timeout=10).read()


def test_a_server_at_another_weight_version_is_refused_by_name(tmp_path):
    engine = Engine(str(make_tiny_checkpoint(tmp_path, "qwen2", seed=0)))
    srv = serve(engine, api_key=KEY)
    client = RolloutClient([srv.url], api_key=KEY)
    try:
        check_server_versions(client, 0)  # a fresh server serves the start checkpoint: "0"
        _set_version(srv.url, "default")
        check_server_versions(client, 0)  # SGLang's launch default names the start checkpoint too
        _set_version(srv.url, "2")
        with pytest.raises(ValueError, match=rf"{srv.url} serves weight version '2'.*starts at version 0"):
            check_server_versions(client, 0)
        check_server_versions(client, 2)  # a resumed run at version 2 accepts it
        _set_version(srv.url, "step-7")  # not a version any trainer set
        with pytest.raises(ValueError, match="'step-7'"):
            check_server_versions(client, 7)
    finally:
        client.close()
        srv.shutdown()
        engine.shutdown()


def test_a_debiasing_family_checks_its_servers_for_debiased_k_under_kv_auto(tmp_path):
    """quant.kv=auto on a Qwen2: the resolved policy stores K de-biased, so every http server must serve
    a de-biased K cache; the check reads the resolved policy, not the config's unset kv_k_debias."""
    ckpt = make_tiny_checkpoint(tmp_path, "qwen2", seed=0)
    cfg = Config.load(None, ["rollout.backend=http", "rollout.api_key=" + KEY])
    assert cfg.quant.kv == "auto" and not cfg.quant.kv_k_debias  # as written: nothing says de-biased
    policy = cfg.quant.resolve(ModelArch.from_hf_config(ckpt))
    assert policy.kv_k_debias  # as it runs
    plain = Engine(str(ckpt), quant_policy=QuantPolicy(kv="bf16", kv_k="fp8", kv_v="nvfp4"))
    debiased = Engine(str(ckpt), quant_policy=policy)
    servers = [serve(e, api_key=KEY) for e in (plain, debiased)]
    try:
        run_cfg = Config.load(
            None, ["rollout.backend=http", f"rollout.api_key={KEY}", f"rollout.urls=[{servers[0].url}]"]
        )
        with pytest.raises(ValueError, match=rf"{servers[0].url} does not serve a de-biased K cache"):
            rollout_backend(run_cfg, policy, ckpt)
        ok = Config.load(None, ["rollout.backend=http", f"rollout.api_key={KEY}", f"rollout.urls=[{servers[1].url}]"])
        rollout_backend(ok, policy, ckpt).close()
    finally:
        for srv, e in zip(servers, (plain, debiased)):
            srv.shutdown()
            e.shutdown()
