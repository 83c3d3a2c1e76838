"""Named fault-injection points: the places where a test kills a process, or makes it fail, on purpose.

    run.Run.step:    rollout.done(step) ─► train.done(step) ─► [weight sync] ─► checkpoint
    transfer._send:  transfer.unit(version, unit)  (before unit i of a version is handed to the transport)
    Actor.save_checkpoint:  checkpoint.shard_written(step)   (shard on disk, not yet committed)
    local Scheduler.step:   engine.decode_step(n)            (n-th decode step with requests in flight)

Production code calls `hit(name, **where)`: one dict lookup when nothing is armed. A test arms a
point inside the process it means to kill (`tests/mp_scripts/with_fault.py` does it before
running a module), so the kill lands at that exact place whatever the machine's speed: no
clock decides where it happens. `raise_error` instead raises there (an op failing inside a
batch, as oneDNN's bf16 reorder did on a CPU without bf16 support), for what the code above the
point makes of the error. This module imports nothing of the project, so the rollout
side (`sglang_backend`) may call it too.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable

# Every point and the integer keys that say where it was hit; arm() refuses anything else, so a
# misspelt point fails the test that armed it instead of never firing.
POINTS: dict[str, tuple[str, ...]] = {
    "rollout.done": ("step",),
    "train.done": ("step",),
    "checkpoint.shard_written": ("step", "rank"),
    "engine.decode_step": ("n",),
    "transfer.unit": ("version", "unit"),
}

Action = Callable[[str, dict], None]
_armed: dict[str, list[tuple[dict, Action]]] = {}


def kill_self(name: str, where: dict) -> None:
    """SIGKILL this process (no cleanup, no atexit: what a node failure or OOM kill does)."""
    print(f"[fault] SIGKILL at {name} {where}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class InjectedFault(RuntimeError):
    """What `raise_error` raises at an armed point."""


def raise_error(name: str, where: dict) -> None:
    """Raise InjectedFault at the point: the process lives on, and its error handling is what is tested."""
    raise InjectedFault(f"injected fault at {name} {where}")


def arm(name: str, action: Action = kill_self, **where: int) -> None:
    """Run `action` when `name` is hit with exactly these keys' values (unnamed keys match any)."""
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r}; known: {', '.join(sorted(POINTS))}")
    bad = sorted(set(where) - set(POINTS[name]))
    if bad:
        raise ValueError(f"fault point {name} has keys {POINTS[name]}; got {bad}")
    _armed.setdefault(name, []).append((dict(where), action))


def disarm_all() -> None:
    _armed.clear()


def hit(name: str, **where: int) -> None:
    """Called at the named place; fires the actions armed for it."""
    for want, action in _armed.get(name, ()):
        if all(where.get(k) == v for k, v in want.items()):
            action(name, where)


def parse_spec(spec: str) -> tuple[str, dict[str, int]]:
    """'train.done:step=2' or 'engine.decode_step:n=3' -> (name, {key: value})."""
    name, _, rest = spec.partition(":")
    where = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not value.lstrip("-").isdigit():
            raise ValueError(f"fault spec {spec!r}: expected name:key=INT[,key=INT]")
        where[key] = int(value)
    return name, where
