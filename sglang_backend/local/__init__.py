"""The embedded rollout engine (sglang.Engine's API, our FP4 numerics) and its HTTP server."""

from .engine import Engine
from .inprocess import InProcessBackend

__all__ = ["Engine", "InProcessBackend"]
