"""SGLang's own `/update_weights_from_tensor` format, for a trainer COLOCATED with the server.

    t = SGLangTensorTransport(["http://127.0.0.1:30000"], api_key=KEY, tp_size=1)
    t.send(buckets, version)

A real SGLang 0.5.23 server takes JSON `UpdateWeightsFromTensorReqInput`: `serialized_named_tensors`
holds one payload per TP rank, each `MultiprocessingSerializer.serialize([(name, tensor), ...],
output_str=True)`: torch's ForkingPickler, base64. The tensors are NOT in the payload: ForkingPickler
shares them (CPU: named shared-memory files, see `_serialize`; GPU: CUDA IPC handles), so the server
must run on the same node, while this process keeps the tensors alive
(until the POST returns, which `send` does). Across nodes use DistributedTransport or
DiskTransport. The payload is made by SGLang's own serializer (imported from the sglang package,
which a colocated trainer has) and read by SGLang's restricted unpickler: this is the one place a
pickle crosses a process boundary, and it is SGLang's protocol, not ours.

Our embedded server keeps its no-pickle rule: its `/update_weights_from_tensor` takes safetensors
bytes (HttpTransport), which also work across nodes; a body SGLang's way is refused there, and
safetensors bytes are refused (HTTP 400) by SGLang. Like DistributedTransport, the update runs inside
SGLang's weight-update session (`/begin_weight_update` ... `/end_weight_update`, which rebuilds the
quant methods' derived state: the ModelOpt scales are refreshed in place).
"""

from __future__ import annotations

import time

from sglang_backend.api import serves_version, wire_version

from .transports import TransferError, TransferStats, Transport, _get_json, _merge, _post


def begin_sessions(urls: list[str], api_key: str | None, timeout_s: float) -> list[str]:
    """Open SGLang's weight-update session on every server that has one (404: none, e.g. ours)."""
    opened = []
    for u in urls:
        r = _post(u, "/begin_weight_update", {}, api_key, timeout_s)
        if not r.get("success") and "already open" in str(r.get("message")):  # left by a dead sender
            _post(u, "/end_weight_update", {}, api_key, timeout_s)
            r = _post(u, "/begin_weight_update", {}, api_key, timeout_s)
        if r.get("success"):
            opened.append(u)
        elif r.get("status") != 404:
            end_sessions(opened, api_key, timeout_s)
            raise TransferError(f"{u}: begin_weight_update failed: {r.get('message')}")
    return opened


def end_sessions(urls: list[str], api_key: str | None, timeout_s: float) -> None:
    bad = {
        u: r.get("message")
        for u in urls
        if not (r := _post(u, "/end_weight_update", {}, api_key, timeout_s)).get("success")
    }
    if bad:
        raise TransferError(f"end_weight_update failed: {bad}")


class SGLangTensorTransport(Transport):
    """Every bucket of one version in ONE SGLang `/update_weights_from_tensor` call per server."""

    def __init__(self, urls: list[str] | str, api_key: str | None = None, tp_size: int = 1, timeout_s: float = 300.0):
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        self.api_key, self.tp_size, self.timeout_s = api_key, int(tp_size), timeout_s
        try:
            from sglang.srt.utils import MultiprocessingSerializer
        except ImportError as e:
            raise TransferError(
                "SGLangTensorTransport needs the sglang package (a colocated trainer shares "
                f"tensors with the server through SGLang's serializer): {e}"
            ) from e
        self._serializer = MultiprocessingSerializer

    def _serialize(self, named) -> str:
        """CPU tensors are shared by shm file NAME (torch's file_system strategy) for this payload: the
        default fd passing makes the server connect back with this process tree's multiprocessing
        authkey, which a separately launched server does not have (its scheduler dies with
        AuthenticationError). CUDA tensors travel as CUDA IPC handles either way."""
        import torch.multiprocessing as mp

        prev = mp.get_sharing_strategy()
        mp.set_sharing_strategy("file_system")
        try:
            return self._serializer.serialize(named, output_str=True)
        finally:
            mp.set_sharing_strategy(prev)

    def send(self, buckets, version, *, manifest=None) -> TransferStats:
        stats, t0 = TransferStats(version), time.perf_counter()
        merged = _merge(buckets, version, stats)  # raises (NaN, duplicates) before anything is sent
        named = [(n, t.detach().contiguous()) for n, t in merged.tensors.items()]
        payload = self._serialize(named)
        body = {
            "serialized_named_tensors": [payload] * self.tp_size,
            "flush_cache": True,
            "weight_version": wire_version(version),
        }
        opened = begin_sessions(self.urls, self.api_key, self.timeout_s)
        try:
            bad = {
                u: r.get("message")
                for u in self.urls
                if not (r := _post(u, "/update_weights_from_tensor", body, self.api_key, self.timeout_s)).get("success")
            }
        finally:
            end_sessions(opened, self.api_key, self.timeout_s)
        del named  # the servers have loaded: the shared tensors may go
        if bad:
            raise TransferError(f"version {version} refused: {bad}")
        got = {u: _get_json(u, "/model_info", self.api_key).get("weight_version") for u in self.urls}
        if not all(serves_version(v, version) for v in got.values()):
            raise TransferError(f"servers report versions {got} after sending {version}")
        stats.bytes, stats.seconds = merged.nbytes(), time.perf_counter() - t0
        return stats
