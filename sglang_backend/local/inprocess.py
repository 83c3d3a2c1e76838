"""The embedded engine behind the RolloutBackend contract, in the trainer's own process."""

from __future__ import annotations

from typing import Any

from sglang_backend.api import GenerateRequest, GenerateResult, WeightBucket

from .engine import Engine


class InProcessBackend:
    def __init__(self, engine: Engine):
        self.engine = engine

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        # One submission, so every run admits the same groups together: batch composition, hence
        # every rounding, is reproducible. This thread runs the steps (Engine: drive).
        rids = self.engine.submit_all(requests, drive=True)
        return self.engine.wait([r for rs in rids for r in rs])

    def update_weights(self, bucket: WeightBucket, *, flush_cache: bool = True) -> None:
        """Pause, load, flush, resume: the version moves only if the whole bucket loaded."""
        self.engine.pause_generation()
        try:
            ok, msg = self.engine.update_weights_from_bucket(bucket, flush_cache=flush_cache)
        finally:
            self.engine.continue_generation()
        if not ok:
            raise RuntimeError(msg)

    def pause(self) -> None:
        self.engine.pause_generation()

    def resume(self) -> None:
        self.engine.continue_generation()

    def flush_cache(self) -> None:
        if not self.engine.flush_cache():
            raise RuntimeError("flush_cache refused: requests are running")

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.engine.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.engine.resume_memory_occupation(tags)

    def health(self) -> bool:
        return self.engine.is_alive()

    def model_info(self) -> dict[str, Any]:
        return self.engine.get_model_info()

    def fetch_guidance(self, handle: str) -> bytes:
        return self.engine.fetch_guidance(handle)

    def note_version(self, version: int) -> None:
        """Nothing to do: the in-process transport loads through update_weights, which sets the version."""

    def close(self) -> None:
        self.engine.shutdown()
