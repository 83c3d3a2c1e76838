"""The embedded server's weight-update endpoints (SGLang's names and answers), as one mixin of `RolloutServer`.

/update_weights_from_tensor, /update_weights_from_disk, /init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group, /update_weight_version. Every
update answers {"success", "message"} with 200 or 400; a refused or broken update leaves the
served weights (and version) as they were.

Deliberate difference from SGLang — NO PICKLE: SGLang's /update_weights_from_tensor takes
pickled CUDA-IPC handles, which would let any caller run code here. This server accepts either
  * JSON `{"serialized_named_tensors": [<base64 safetensors>, ...], "weight_version", "flush_cache"}`
    (each payload is safetensors bytes, e.g. `WeightBucket.to_bytes()`; all are merged), or
  * a raw `Content-Type: application/octet-stream` body holding one `WeightBucket.to_bytes()`;
    the version comes from the bucket header, `?flush_cache=false` in the query string.
"""

from __future__ import annotations

import base64
import binascii
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fastapi import Request
from fastapi.responses import Response
from safetensors import safe_open

from megatron_trace.models import ModelArch
from sglang_backend.api import WeightBucket
from sglang_backend.weight_group import WeightGroup, dtype_from_name

from .engine import Engine
from .http_util import HTTPError, as_version, json_response, read_body, read_json, want
from .loader import checkpoint_files


class WeightUpdateRoutes:
    """The weight endpoints; `RolloutServer` supplies the state below and runs the blocking parts in its pool."""

    engine: Engine
    groups: dict[str, WeightGroup]  # open weight-update groups by name
    dist_timeout_s: float  # rendezvous and broadcast timeout of a new group
    _lock: threading.Lock  # guards `groups`
    _blocking: Callable[..., Any]  # async: run fn(*args) in the server's thread pool

    def _apply(self, named, flush: bool, version: str | int | None, what: str) -> Response:
        ok, msg = self.engine.update_weights_from_tensor(named, flush_cache=flush, weight_version=version)
        return json_response(200 if ok else 400, {"success": ok, "message": f"{what}: {msg}"})

    async def update_from_tensor(self, request: Request) -> Response:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype == "application/octet-stream":
            raw = await read_body(request)
            flush = request.query_params.get("flush_cache", "true").lower() not in ("0", "false", "no")
            return await self._blocking(self._apply_bucket, raw, flush)
        return await self._blocking(self._apply_base64, await read_json(request, required=True))

    def _apply_bucket(self, raw: bytes, flush: bool) -> Response:
        try:
            bucket = WeightBucket.from_bytes(raw)
        except ValueError as e:
            raise HTTPError(400, str(e)) from None
        return self._apply(bucket.tensors, flush, bucket.version, "octet-stream bucket")

    def _apply_base64(self, d: dict[str, Any]) -> Response:
        payloads = want(d, "serialized_named_tensors", list)
        named: dict[str, torch.Tensor] = {}
        for i, p in enumerate(payloads):
            if not isinstance(p, str):
                raise HTTPError(
                    400,
                    f"serialized_named_tensors[{i}] must be a base64 safetensors string "
                    "(this server accepts no pickle)",
                )
            try:
                named.update(WeightBucket.from_bytes(base64.b64decode(p, validate=True)).tensors)
            except (ValueError, binascii.Error) as e:
                raise HTTPError(400, f"serialized_named_tensors[{i}]: {e}") from None
        return self._apply(
            named,
            bool(want(d, "flush_cache", bool, True)),
            as_version(d.get("weight_version")),
            f"{len(payloads)} safetensors payloads",
        )

    async def update_from_disk(self, request: Request) -> Response:
        return await self._blocking(self._update_from_disk, await read_json(request, required=True))

    def _update_from_disk(self, d: dict[str, Any]) -> Response:
        path = Path(want(d, "model_path", str))
        fmt = d.get("load_format")
        if fmt not in (None, "auto", "safetensors"):
            raise HTTPError(400, f"load_format must be auto or safetensors; got {fmt!r}")
        version = as_version(d.get("weight_version"))
        try:  # same architecture only: a new checkpoint of the served model, not a new model
            if ModelArch.from_hf_config(path) != self.engine.arch:
                raise ValueError(f"{path} holds a different model than the one served ({self.engine.model_path})")
            named = []
            for f in checkpoint_files(path):
                with safe_open(str(f), framework="pt") as fh:
                    named += [(k, fh.get_tensor(k)) for k in fh.keys()]
        except Exception as e:  # missing dir, bad config, corrupt file: all a refusal, not a crash
            still = f"still serving version {self.engine.weight_version}"
            return json_response(400, {"success": False, "message": f"cannot load {path}: {e}; {still}"})
        answer = self._apply(named, bool(want(d, "flush_cache", bool, True)), version, f"from disk {path}")
        if answer.status_code == 200:
            self.engine.model_path = path
        return answer

    async def init_group(self, request: Request) -> Response:
        return await self._blocking(self._init_group, await read_json(request, required=True))

    def _init_group(self, d: dict[str, Any]) -> Response:
        addr, port = want(d, "master_address", str), want(d, "master_port", int)
        offset, world = want(d, "rank_offset", int), want(d, "world_size", int)
        name = want(d, "group_name", str, "weight_update_group")
        backend = want(d, "backend", str, "gloo")
        # tp = 1: this server is exactly one rank, `rank_offset`; rank 0 is the trainer.
        if not (1 <= offset < world):
            raise HTTPError(
                400,
                f"rank_offset {offset} / world_size {world} do not fit this server: it is one "
                "rank (tp=1) and rank 0 is the trainer, so need 1 <= rank_offset < world_size",
            )
        if backend != "gloo":
            raise HTTPError(400, f"backend {backend!r} is not supported by the embedded server; use 'gloo'")
        with self._lock:
            if name in self.groups:
                raise HTTPError(400, f"weight update group {name!r} already exists; destroy it first")
        try:
            group = WeightGroup(addr, port, offset, world, name, self.dist_timeout_s)
        except Exception as e:
            return json_response(400, {"success": False, "message": f"init of group {name!r} failed: {e}"})
        with self._lock:
            self.groups[name] = group
        return json_response(200, {"success": True, "message": f"joined {name!r} as rank {offset} of {world}"})

    async def update_from_distributed(self, request: Request) -> Response:
        return await self._blocking(self._update_from_distributed, await read_json(request, required=True))

    def _update_from_distributed(self, d: dict[str, Any]) -> Response:
        names, dtypes, shapes = want(d, "names", list), want(d, "dtypes", list), want(d, "shapes", list)
        name = want(d, "group_name", str, "weight_update_group")
        if not len(names) == len(dtypes) == len(shapes):
            raise HTTPError(400, f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
        try:
            dts = [dtype_from_name(x) for x in dtypes]
        except ValueError as e:
            raise HTTPError(400, str(e)) from None
        for n, s in zip(names, shapes):
            if not isinstance(n, str) or not isinstance(s, list) or not all(type(x) is int and x >= 0 for x in s):
                raise HTTPError(400, f"bad entry {n!r}: names are strings, shapes lists of ints >= 0")
        version = as_version(d.get("weight_version"))
        group = self.groups.get(name)
        if group is None:
            raise HTTPError(400, f"no weight update group {name!r}; call /init_weights_update_group first")
        try:  # everything arrives before anything loads: a broken transfer changes nothing
            named = group.receive(names, dts, shapes)
        except Exception as e:
            with self._lock:  # its broadcast sequence is out of step now; the trainer must re-init
                self.groups.pop(name, None)
            group.close()
            still = f"still serving version {self.engine.weight_version}"
            return json_response(
                400, {"success": False, "message": f"transfer failed ({e}); group {name!r} dropped; {still}"}
            )
        return self._apply(
            named, bool(want(d, "flush_cache", bool, True)), version, f"{len(named)} tensors from {name!r}"
        )

    async def destroy_group(self, request: Request) -> Response:
        name = want(await read_json(request), "group_name", str, "weight_update_group")
        with self._lock:
            group = self.groups.pop(name, None)
        if group is None:
            return json_response(400, {"success": False, "message": f"no weight update group {name!r}"})
        await self._blocking(group.close)
        return json_response(200, {"success": True, "message": f"destroyed {name!r}"})

    async def update_weight_version(self, request: Request) -> Response:
        v = as_version(want(await read_json(request, required=True), "new_version", (str, int)), "new_version")
        self.engine.weight_version = v
        return json_response(200, {"success": True, "message": f"weight version is {v}"})
