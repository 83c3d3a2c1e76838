"""Bad input: each a clear error (or the configured, counted handling) and no state change.

Covered elsewhere and not repeated here: NaN/Inf weights refused before sending, naming the
parameter (tests/test_transfer.py, tests/test_client.py); malformed config values
(tests/test_config.py); tokens outside the vocabulary -> 400 (tests/test_server_http.py
test_generate_rejects, tests/test_client.py test_4xx_raises_without_retry); a full disk under the
guidance spill (tests/test_guidance_store.py test_enospc_*) and under a checkpoint save, and a
truncated trainer checkpoint shard (tests/test_faults_trainer.py).
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from megatron_trace.config import Config
from megatron_trace.data import CharTokenizer
from megatron_trace.models.tiny import make_tiny_checkpoint
from megatron_trace.rl import Sample
from megatron_trace.trainer.batching import Partition, plan
from sglang_backend.api import GenerateRequest, GenerateResult, WeightBucket
from sglang_backend.local import Engine
from sglang_backend.local.server import serve
from tests.helpers import tiny_rollout

KEY = "input-key"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "m", "qwen2", seed=0)


# -- prompts longer than the context ------------------------------------------------------------
class _Prompts:
    def __init__(self, texts):
        self.items = [SimpleNamespace(text=t, prompt_id=f"p{i}", answer="1") for i, t in enumerate(texts)]

    def sample(self, n, step):
        return self.items[:n]


class _Backend:
    """Answers each request with n one-token results; remembers what it was sent."""

    def __init__(self):
        self.sent: list[GenerateRequest] = []

    def generate(self, reqs):
        self.sent += reqs
        return [
            GenerateResult(f"{r.rid}-{k}", [5], [-0.1], {"type": "length"}, len(r.input_ids), 0)
            for r in reqs
            for k in range(r.sampling_params.n)
        ]


@pytest.mark.parametrize("mode", ["reject", "truncate"])
def test_long_prompts_rejected_or_truncated_and_counted(mode):
    tok = CharTokenizer()
    texts = ["1+2=", "9" * 40 + "+1=", "3+3=", "8" * 30 + "-1="]
    cfg = Config.load(
        None,
        [
            "rollout.max_prompt_len=12",
            f"rollout.long_prompts={mode}",
            "rollout.n_samples=2",
            "rollout.prompts_per_step=4",
            "trainer.qat_mode=rtn",
        ],
    )
    backend = _Backend()
    batch = tiny_rollout(cfg, backend, tok, _Prompts(texts), lambda text, answer: 1.0).run(step=0, version=0)
    long_ids = [tok.encode_prompt(t) for t in texts if len(tok.encode_prompt(t)) > 12]
    assert len(long_ids) == 2
    if mode == "reject":
        assert batch.stats["prompts_rejected"] == 2 and batch.stats["prompts_truncated"] == 0
        assert [r.rid for r in backend.sent] == ["p0-v0", "p2-v0"]  # the long ones never reach the rollout
        assert len(batch.samples) == 4 and {s.prompt_id for s in batch.samples} == {"p0", "p2"}
    else:
        assert batch.stats["prompts_truncated"] == 2 and batch.stats["prompts_rejected"] == 0
        assert len(backend.sent) == 4 and all(len(r.input_ids) <= 12 for r in backend.sent)
        assert backend.sent[1].input_ids == long_ids[0][-12:]  # keeps the end (the question)
        assert len(batch.samples) == 8


# -- corrupted / truncated safetensors ----------------------------------------------------------
def _damaged_copies(ckpt, tmp_path):
    data = (ckpt / "model.safetensors").read_bytes()
    out = {}
    for kind, body in {"truncated": data[: len(data) * 2 // 3], "header": b"\xff" * 16 + data[16:]}.items():
        d = tmp_path / kind
        shutil.copytree(ckpt, d)
        (d / "model.safetensors").write_bytes(body)
        out[kind] = d
    return out


def test_engine_refuses_damaged_checkpoint_naming_the_file(ckpt, tmp_path):
    for kind, d in _damaged_copies(ckpt, tmp_path).items():
        with pytest.raises(ValueError, match=r"model\.safetensors") as e:
            Engine(str(d))
        assert str(d) in str(e.value), (kind, str(e.value))


def test_weight_bucket_from_damaged_bytes():
    raw = WeightBucket({"a.weight": torch.ones(64, 64), "b.bias": torch.zeros(64)}, 3).to_bytes()
    for bad, needle in [
        (raw[:4], "truncated"),
        (raw[:60], "truncated"),
        (raw[: len(raw) - 100], "corrupt"),
        (b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"{not json at all", "corrupt"),
    ]:
        with pytest.raises(ValueError, match=needle):
            WeightBucket.from_bytes(bad)
    assert WeightBucket.from_bytes(raw).version == 3


def test_server_refuses_damaged_weights_and_keeps_serving(ckpt, tmp_path):
    """update_weights_from_disk / from_tensor with damaged safetensors: 400, version and weights unchanged."""
    engine = Engine(str(ckpt))
    srv = serve(engine, api_key=KEY)
    try:
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}

        def post(path, data, ctype="application/json"):
            req = urllib.request.Request(
                srv.url + path,
                data=data,
                method="POST",
                headers={"Authorization": f"Bearer {KEY}", "Content-Type": ctype},
            )
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        for kind, d in _damaged_copies(ckpt, tmp_path).items():
            status, out = post(
                "/update_weights_from_disk", json.dumps({"model_path": str(d), "weight_version": 7}).encode()
            )
            assert status == 400 and not out["success"] and str(d) in out["message"], (kind, out)
            assert "still serving version 0" in out["message"]
        raw = WeightBucket(load_file(str(ckpt / "model.safetensors")), 9).to_bytes()
        status, out = post("/update_weights_from_tensor", raw[: len(raw) // 2], "application/octet-stream")
        assert status == 400 and "weight bucket" in out["error"]["message"], out
        assert engine.weight_version == "0"
        after = engine.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), "a damaged update changed the weights"
    finally:
        srv.shutdown()
        engine.shutdown()


# -- guidance records that do not match the sample ----------------------------------------------
def test_guidance_record_of_wrong_length_is_a_clear_error(ckpt):
    engine = Engine(str(ckpt), quantization="nvfp4")
    try:
        out = engine.generate(
            input_ids=[3, 4, 5],
            sampling_params={"max_new_tokens": 4, "temperature": 0},
            return_logprob=True,
            return_guidance=True,
        )
        rec = engine.fetch_guidance(out["meta_info"]["guidance_handle"])
    finally:
        engine.shutdown()
    resp = out["output_ids"]
    good = Sample("s0", [3, 4, 5], resp, [-0.1] * len(resp), 1.0, rec)
    plan([good], packed=True, budget=64, batch=2, part=Partition())  # the matching record passes
    for prompt, response in [([3, 4, 5, 6, 7], resp), ([3, 4, 5], resp[:-2])]:  # record for another length
        bad = Sample("s1", prompt, response, [-0.1] * len(response), 1.0, rec)
        with pytest.raises(ValueError, match=r"covers \d+ positions; the sample needs \d+"):
            plan([good, bad], packed=True, budget=64, batch=2, part=Partition())
