"""The trainer's checkpoints: root/step_N holds one shard per rank (model, optimizer, RNG) and
meta.json; root/latest names the newest. Saves are atomic (written as step_N.tmp, renamed by rank
0), so a crash mid-save leaves the previous checkpoint as latest; a load checks the world size."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_trace import faults


def save(
    root: str | os.PathLike, step: int, model, optimizer, extra: dict | None = None, keep: int = 0, scheduler=None
) -> Path:
    """Write root/step_N atomically: every rank writes into step_N.tmp, then rank 0 renames it
    and points root/latest at it. A crash mid-save leaves the previous checkpoint as latest. With
    keep > 0, only the newest `keep` checkpoints stay (older ones are deleted once latest names
    the new one: a crash before that keeps them all)."""
    root = Path(root)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    shard = tmp / f"rank_{rank:05d}.pt"
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
        "lr_scheduler": None if scheduler is None else scheduler.state_dict(),
    }
    try:  # only the write: a state_dict's own error is not a disk's and keeps its message
        torch.save(state, shard)
    except (OSError, RuntimeError) as e:  # a full disk reaches torch's zip writer as a bare RuntimeError
        written = shard.stat().st_size if shard.exists() else 0
        shard.unlink(missing_ok=True)  # a partial shard only holds the disk; the other ranks' are theirs
        free = shutil.disk_usage(root).free
        raise OSError(
            f"checkpoint step {step}: writing {shard} failed after {written / 2**30:.2f} GiB with "
            f"{free / 2**30:.2f} GiB free on its disk ({type(e).__name__}: {e}); the previous checkpoint "
            f"stays latest. Free space under {root}, keep fewer (trainer.keep_checkpoints) or point "
            f"logging.run_dir at a larger disk"
        ) from e
    faults.hit("checkpoint.shard_written", step=step, rank=rank)
    _barrier()
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps({"step": step, "world_size": _world(), **(extra or {})}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest_tmp = root / "latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, root / "latest")
        if keep:
            _prune(root, keep)
    _barrier()
    return final


def _prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` step_N directories (by step number)."""
    saved = sorted((int(p.name[5:]), p) for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit())
    for _, old in saved[:-keep]:
        shutil.rmtree(old)


def load(root: str | os.PathLike, model, optimizer, scheduler=None) -> dict:
    """Load root/latest; returns its meta (step and what the caller stored). `scheduler`: the run's LR
    scheduler (trainer.lr_warmup_steps), restored to where the saved run was in its warmup."""
    root = Path(root)
    pointer = root / "latest"
    if not pointer.exists():
        raise FileNotFoundError(f"no checkpoint under {root} (missing 'latest')")
    ckpt = root / pointer.read_text().strip()
    meta = json.loads((ckpt / "meta.json").read_text())
    if meta.get("world_size") != _world():
        raise ValueError(f"checkpoint {ckpt} was saved by {meta.get('world_size')} ranks; this run has {_world()}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        state = torch.load(ckpt / f"rank_{rank:05d}.pt", weights_only=False)
    except Exception as e:
        raise ValueError(f"checkpoint shard {ckpt}/rank_{rank:05d}.pt is unreadable: {e}") from None
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        if state.get("lr_scheduler") is None:
            raise ValueError(
                f"checkpoint {ckpt} holds no LR scheduler state, but this run warms its LR up "
                "(trainer.lr_warmup_steps > 0): resume with the saved run's trainer.lr_warmup_steps=0"
            )
        scheduler.load_state_dict(state["lr_scheduler"])
    torch.set_rng_state(state["rng"])
    return meta


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
