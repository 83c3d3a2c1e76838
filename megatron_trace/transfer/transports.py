"""Ways to move one weight version to the rollout: `Transport.send_units(units, version) -> stats`.

A version arrives as a stream of units (one fused group's or one module's rollout tensors, see
quantize.py). The transports that cross a process boundary pack them into `WeightBucket`s under
`transfer.bucket_mb` (bucket.py) and send those (`send(buckets, version)`); the in-process one hands
the tensors to the engine as they are.

Atomicity ("never a mix of versions"): the rollout engine commits each update call all or
nothing, and the version moves only with a committed call. So every transport here makes ONE
receiver commit per version:

* InProcessTransport: the version's tensors (references, no copy, no buckets) in one
  `update_weights` call. Costs holding the whole rollout model on the trainer side; in-process the
  engine holds it anyway.
* HttpTransport: the buckets are merged into one safetensors body (`/update_weights_from_tensor`
  octet-stream). Bounded by the server's body limit (`max_body_bytes` in /model_info, checked
  before sending); beyond it use DistributedTransport or DiskTransport.
* DistributedTransport: one `/update_weights_from_distributed` POST announces every tensor of the
  version (names/dtypes/shapes from a manifest computed from the architecture, no data needed),
  then the buckets are broadcast one after another while the server receives everything before
  loading. This is the only transport that really streams (trainer memory ~ one bucket). A
  failure mid-stream (NaN, dead sender, broken stream) closes the group; the server's receive
  fails, it drops the group and keeps the previous version; the next send re-creates the group.
* DiskTransport: an HF-style directory per version, then `/update_weights_from_disk`.
* SGLangTensorTransport (sglang_tensor.py): SGLang's own `/update_weights_from_tensor` payload
  (MultiprocessingSerializer: shared tensors, same node only) for a trainer colocated with a real
  SGLang server; HttpTransport's safetensors body is what our embedded server takes (no pickle).

Staging buckets on the receiver and committing on the last one would let HTTP stream too; that
needs an engine change (a `stage` flag on update_weights_from_tensor), so it is not used here.
After every send the rollout must report `version`, else `TransferError`.
"""

from __future__ import annotations

import abc
import gc
import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sglang_backend.api import WeightBucket, serves_version, wire_version

from .bucket import BucketStats, pack_buckets
from .quantize import NonFiniteWeightError, Unit, check_finite

Manifest = list[tuple[str, torch.dtype, tuple[int, ...]]]


class TransferError(RuntimeError):
    """A version was not committed; the rollout still serves the previous one."""


@dataclass
class TransferStats:
    version: int
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0  # bytes on the wire (tensor payload; HTTP: the body)
    seconds: float = 0.0


class Transport(abc.ABC):
    """Sends all of one version so that the rollout commits it as one update."""

    def send_units(
        self,
        units: Iterable[Unit],
        version: int,
        *,
        manifest: Manifest | None = None,
        bucket_mb: float = 512.0,
        bucket_stats: BucketStats | None = None,
    ) -> TransferStats:
        """A version's units, packed into buckets under `bucket_mb` for the wire."""
        return self.send(pack_buckets(units, version, bucket_mb, stats=bucket_stats), version, manifest=manifest)

    @abc.abstractmethod
    def send(
        self, buckets: Iterable[WeightBucket], version: int, *, manifest: Manifest | None = None
    ) -> TransferStats: ...

    def close(self) -> None:  # noqa: B027 - optional hook: most transports hold nothing to release
        pass


def _merge(buckets: Iterable[WeightBucket], version: int, stats: TransferStats) -> WeightBucket:
    merged: dict[str, torch.Tensor] = {}
    for b in buckets:
        if b.version != version:
            raise TransferError(f"bucket carries version {b.version}, transfer is version {version}")
        dup = set(b.tensors) & set(merged)
        if dup:
            raise TransferError(f"tensor {sorted(dup)[0]!r} sent twice in version {version}")
        merged.update(b.tensors)
        stats.buckets += 1
    stats.tensors = len(merged)
    return WeightBucket(merged, version)


class InProcessTransport(Transport):
    """Any object with `update_weights(bucket)` (+ `model_info()` for the version check)."""

    def __init__(self, backend: Any):
        self.backend = backend

    def send_units(self, units, version, *, manifest=None, bucket_mb=512.0, bucket_stats=None) -> TransferStats:
        """The version's tensors straight to the engine: no buckets in one process."""
        stats, t0 = TransferStats(version), time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        for unit in units:
            for name, t in unit:
                check_finite(name, t)  # raises before the backend sees anything
                if name in tensors:
                    raise TransferError(f"tensor {name!r} sent twice in version {version}")
                tensors[name] = t
        stats.tensors = len(tensors)
        return self._load(WeightBucket(tensors, version), stats, t0)

    def send(self, buckets, version, *, manifest=None) -> TransferStats:
        stats, t0 = TransferStats(version), time.perf_counter()
        return self._load(_merge(buckets, version, stats), stats, t0)  # raises (NaN, ...) before loading

    def _load(self, bucket: WeightBucket, stats: TransferStats, t0: float) -> TransferStats:
        stats.bytes = bucket.nbytes()
        self.backend.update_weights(bucket)
        info = getattr(self.backend, "model_info", None)
        if info is not None and not serves_version(info().get("weight_version"), bucket.version):
            raise TransferError(
                f"rollout reports version {info().get('weight_version')} after sending {bucket.version}"
            )
        stats.seconds = time.perf_counter() - t0
        return stats


class HttpTransport(Transport):
    """`RolloutClient` -> every server's `/update_weights_from_tensor`, one body per version."""

    def __init__(self, client: Any):
        self.client = client

    def send(self, buckets, version, *, manifest=None) -> TransferStats:
        stats, t0 = TransferStats(version), time.perf_counter()
        raw = _merge(buckets, version, stats).to_bytes()
        limit = self.client.model_info().get("max_body_bytes")
        if limit is not None and len(raw) > int(limit):
            raise TransferError(
                f"version {version} is {len(raw)} bytes, over the server's body limit {limit}; "
                "raise --max-body-mb or use DistributedTransport / DiskTransport"
            )
        self.client.update_weights(_RawBucket(raw, version))  # then RolloutClient checks every version
        stats.bytes, stats.seconds = len(raw), time.perf_counter() - t0
        return stats


class _RawBucket(WeightBucket):
    """A bucket already serialized (avoids a second serialization inside RolloutClient)."""

    def __init__(self, raw: bytes, version: int):
        super().__init__({}, version)
        self._raw = raw

    def to_bytes(self) -> bytes:
        return self._raw


def _post(url: str, path: str, payload: dict, api_key: str | None, timeout: float) -> dict:
    """One JSON POST without retries (a retried blocking broadcast endpoint would hang)."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url + path, data=json.dumps(payload).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            d = json.loads(body)
        except ValueError:
            d = {"message": body.decode(errors="replace")}
        err = d.get("error")
        msg = d.get("message") or (err.get("message") if isinstance(err, dict) else err) or f"HTTP {e.code}"
        return {"success": False, "message": f"HTTP {e.code}: {msg}", "status": e.code}


def _get_json(url: str, path: str, api_key: str | None, timeout: float = 30.0) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers), timeout=timeout) as r:
        return json.loads(r.read())


class _Call(threading.Thread):
    def __init__(self, fn, *args):
        super().__init__(daemon=True)
        self.fn, self.args, self.result, self.error = fn, args, None, None

    def run(self):
        try:
            self.result = self.fn(*self.args)
        except Exception as e:  # reported by the caller after join
            self.error = e


class DistributedTransport(Transport):
    """SGLang's `/init_weights_update_group` + `/update_weights_from_distributed`; trainer = rank 0."""

    def __init__(
        self,
        urls: list[str] | str,
        api_key: str | None = None,
        master_address: str = "127.0.0.1",
        master_port: int = 29600,
        group_name: str = "weight_update_group",
        timeout_s: float = 300.0,
        backend: str = "gloo",
    ):
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        self.api_key, self.address, self.port = api_key, master_address, int(master_port)
        self.group_name, self.timeout_s, self.backend = group_name, timeout_s, backend
        self.sender = None

    def connect(self) -> None:
        """Every server joins (POSTs in threads) while we create the master store (rank 0)."""
        from sglang_backend.weight_group import WeightSender

        world = len(self.urls) + 1
        calls = [
            _Call(
                _post,
                u,
                "/init_weights_update_group",
                {
                    "master_address": self.address,
                    "master_port": self.port,
                    "rank_offset": i + 1,
                    "world_size": world,
                    "group_name": self.group_name,
                    "backend": self.backend,
                },
                self.api_key,
                self.timeout_s,
            )
            for i, u in enumerate(self.urls)
        ]
        for c in calls:
            c.start()
        try:
            self.sender = WeightSender(self.address, self.port, world, self.group_name, self.timeout_s, self.backend)
        finally:
            for c in calls:
                c.join()
        self._raise_if_failed(calls, "init_weights_update_group failed")

    def _raise_if_failed(self, calls: list, what: str) -> None:
        """A server that errored or answered success=false drops the group: the next send rebuilds it."""
        bad = [
            (u, c.error or c.result.get("message"))
            for u, c in zip(self.urls, calls)
            if c.error or not c.result.get("success")
        ]
        if bad:
            self._drop(remote=True)
            raise TransferError(f"{what}: {bad}")

    def _drop(self, remote: bool = False) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
            gc.collect()  # frees the gloo pairs now: the servers' pending receives fail at once
        if remote:  # a real SGLang server keeps a failed group; the next connect must re-create it
            for u in self.urls:
                _post(u, "/destroy_weights_update_group", {"group_name": self.group_name}, self.api_key, 30)

    def send(self, buckets, version, *, manifest=None) -> TransferStats:
        if manifest is None:  # no plan: materialize the version (memory: the whole rollout model)
            buckets = list(buckets)
            manifest = [(n, t.dtype, tuple(t.shape)) for b in buckets for n, t in b.tensors.items()]
        if self.sender is None:
            self.connect()
        # SGLang 0.5.23 loads weights only inside a weight-update session (begin ... end; the end re-runs
        # every quant method's process_weights_after_loading: the ModelOpt scales are refreshed in
        # place). Servers without the route (404: our embedded server) commit each call by itself.
        from .sglang_tensor import begin_sessions, end_sessions

        sessions = begin_sessions(self.urls, self.api_key, self.timeout_s)
        try:
            return self._stream(buckets, version, manifest)
        finally:
            end_sessions(sessions, self.api_key, self.timeout_s)

    def _stream(self, buckets, version, manifest) -> TransferStats:
        stats, t0 = TransferStats(version), time.perf_counter()
        from sglang_backend.weight_group import wire_dtype

        # over gloo 1-byte floats (E4M3 weight_scale) are announced and sent as uint8: the receiver's
        # weight loader reinterprets the bytes (gloo cannot broadcast float8, on either side)
        dtypes = [str(wire_dtype(m[1], self.backend)).removeprefix("torch.") for m in manifest]
        payload = {
            "names": [m[0] for m in manifest],
            "dtypes": dtypes,
            "shapes": [list(m[2]) for m in manifest],
            "group_name": self.group_name,
            "weight_version": wire_version(version),
            "flush_cache": True,
        }
        calls = [
            _Call(_post, u, "/update_weights_from_distributed", payload, self.api_key, self.timeout_s)
            for u in self.urls
        ]
        for c in calls:
            c.start()
        i = 0
        try:
            for b in buckets:
                for name, t in b.tensors.items():  # the server allocates from the manifest: must agree
                    if (
                        i >= len(manifest)
                        or manifest[i][0] != name
                        or manifest[i][1] != t.dtype
                        or tuple(t.shape) != manifest[i][2]
                    ):
                        want = manifest[i] if i < len(manifest) else "end of manifest"
                        raise TransferError(
                            f"stream diverged from the manifest at #{i}: got {name} "
                            f"{t.dtype} {tuple(t.shape)}, announced {want}"
                        )
                    i += 1
                self.sender.send(b.tensors)
                stats.buckets += 1
                stats.bytes += b.nbytes()
            if i != len(manifest):
                raise TransferError(f"stream ended after {i} of {len(manifest)} announced tensors")
        except BaseException as e:
            self._drop()  # the servers' receives fail; they keep the previous version
            for c in calls:
                c.join(self.timeout_s)
            self._drop(remote=True)
            if isinstance(e, (TransferError, NonFiniteWeightError)):
                raise
            raise TransferError(f"version {version} aborted after {i} tensors: {e}") from e
        for c in calls:
            c.join()
        self._raise_if_failed(calls, f"version {version} refused")
        stats.tensors, stats.seconds = i, time.perf_counter() - t0
        self._check(version)
        return stats

    def _check(self, version: int) -> None:
        got = {u: _get_json(u, "/model_info", self.api_key).get("weight_version") for u in self.urls}
        if not all(serves_version(v, version) for v in got.values()):
            raise TransferError(f"servers report versions {got} after sending {version}")

    def close(self) -> None:
        if self.sender is not None:
            for u in self.urls:
                _post(u, "/destroy_weights_update_group", {"group_name": self.group_name}, self.api_key, 30)
        self._drop()


class DiskTransport(Transport):
    """Writes `dir/v{version}` (HF layout + config) and has every server load it from disk."""

    def __init__(self, client: Any, directory: str | Path, hf_config: dict, keep: int = 2):
        self.client, self.dir, self.hf_config, self.keep = client, Path(directory), dict(hf_config), keep

    def send(self, buckets, version, *, manifest=None) -> TransferStats:
        from safetensors.torch import save_file

        stats, t0 = TransferStats(version), time.perf_counter()
        final, tmp = self.dir / f"v{version}", self.dir / f"v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        files: list[tuple[str, list[str]]] = []
        for b in buckets:  # one shard per bucket: streams, a failure leaves only the .tmp dir
            fname = f"bucket-{len(files) + 1:05d}.safetensors"
            save_file({k: v.contiguous() for k, v in b.tensors.items()}, str(tmp / fname))
            files.append((fname, list(b.tensors)))
            stats.buckets += 1
            stats.tensors += len(b.tensors)
            stats.bytes += b.nbytes()
        weight_map = {n: f for f, names in files for n in names}
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": stats.bytes}, "weight_map": weight_map})
        )
        (tmp / "config.json").write_text(json.dumps(self.hf_config, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        self.client.update_weights_from_disk(str(final), version)  # raises unless every server reports it
        self._prune(version)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _prune(self, version: int) -> None:
        olds = sorted((int(p.name[1:]), p) for p in self.dir.glob("v*") if p.name[1:].isdigit())
        for v, p in olds[: max(len(olds) - self.keep, 0)]:
            if v != version:
                shutil.rmtree(p, ignore_errors=True)
