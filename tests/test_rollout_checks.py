"""Before the first step the trainer checks what every HTTP rollout server serves: a server left at
another weight version (another run's weights, or a later step's) stops the run by name instead of
sampling from a policy the trainer never had. Real embedded server, real client."""

import json
import urllib.request

import pytest

from megatron_trace.models import make_tiny_checkpoint
from megatron_trace.run.checks import check_server_versions
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
