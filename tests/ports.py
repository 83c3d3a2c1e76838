"""Loopback ports for the tests' servers, rendezvous stores and Slurm daemons.

A port from bind(0) lies in the kernel's ephemeral range, the same range every outgoing
connection draws its source port from: between asking for it and the child process listening
on it, a torchrun rank or gloo pair can take it (CI saw EADDRINUSE that way). So ports come from
below that range, are checked bindable, and are never handed out twice in one test process.
"""
import random
import socket

_given: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and outside the ephemeral range."""
    low, high = 15000, min(_ephemeral_low(), 65536) - 1
    if high <= low:  # the ephemeral range covers everything: fall back to the kernel's choice
        low, high = 1024, 65535
    for _ in range(200):
        port = random.randint(low, high)
        if port in _given:
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {low}..{high} after 200 tries")
