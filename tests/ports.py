"""Loopback ports for the tests' servers, rendezvous stores and Slurm daemons: the product's own
picker (below the ephemeral range, never handed out twice in one process)."""

from sglang_backend.server_process import free_port

__all__ = ["free_port"]
