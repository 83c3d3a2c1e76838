"""trainer.optimizer_offload=disk: Adam's moments leave memory between optimizer steps and come back
bit-exact. The run-level check (a killed and resumed run with the offload, number for number the
resident run) is tests/test_train_loop.py::test_kill_mid_step_then_resume_matches_uninterrupted."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_trace.kernels import cpu_alloc
from megatron_trace.trainer import offload as offload_mod
from megatron_trace.trainer.offload import OptimizerStateOffload


class _Wrapped:
    """What the offload sees of Megatron's optimizer: a torch optimizer under `.optimizer`."""

    def __init__(self, opt):
        self.optimizer = opt


def _model(seed: int, big: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # a parameter whose moments are each `big` fp32 values (their own mmaps), and small odd-sized ones
    return torch.nn.Sequential(torch.nn.Embedding(big // 64, 64), torch.nn.Linear(64, 37), torch.nn.Linear(37, 3))


def _step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model[0].num_embeddings, (512,), generator=g)
    loss = model(ids).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_offloaded_adam_steps_are_the_resident_ones_and_leave_memory(tmp_path):
    big = 1 << 23  # 32 MiB per moment of the embedding
    ref, off = _model(0, big), _model(0, big)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    off_opt = torch.optim.Adam(off.parameters(), lr=1e-2)
    offload = OptimizerStateOffload(_Wrapped(off_opt), tmp_path / "state.bin")
    assert offload.store() == 0 and not offload.offloaded  # no state before the first step
    drops = []
    for step in range(3):
        _step(ref, ref_opt, step)
        with offload.resident():
            _step(off, off_opt, step)
            cpu_alloc.return_freed_memory()
            before = cpu_alloc.resident_gib()
        cpu_alloc.return_freed_memory()
        drops.append((before - cpu_alloc.resident_gib()) * 2**30)
        for a, b in zip(ref.parameters(), off.parameters()):
            assert torch.equal(a, b)
        assert offload.offloaded
        assert all(off_opt.state[p]["exp_avg"] is None for p in off.parameters())
    moments = sum(2 * p.numel() * 4 for p in off.parameters())
    assert offload.bytes >= moments and (tmp_path / "state.bin").stat().st_size == offload.bytes
    assert min(drops) > 0.9 * moments, (drops, moments)  # the moments left memory, not only the file was written
    offload.load()
    for p, q in zip(ref.parameters(), off.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ref_opt.state[p][key], off_opt.state[q][key])
    assert offload.take_seconds() > 0 and offload.take_seconds() == 0
    offload.store()
    offload.close()
    assert not (tmp_path / "state.bin").exists()


@pytest.mark.parametrize("window", [1, 40 << 20])
def test_a_streamed_step_is_the_resident_step_and_holds_its_window(tmp_path, window):
    """stepping(): the optimizer's step a parameter at a time, each one's moments read just before and
    written back just after. Three steps equal torch's resident Adam (AdamW, weight decay: Megatron's)
    bit for bit, and at most the window (or the largest parameter's moments) is held at once."""
    big = 1 << 22  # 16 MiB per moment of the embedding: 32 MiB of state, more than the 1-byte window
    ref, off = _model(0, big), _model(0, big)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    off_opt = torch.optim.AdamW(off.parameters(), lr=1e-2, weight_decay=0.1)
    offload = OptimizerStateOffload(_Wrapped(off_opt), tmp_path / "state.bin", window_bytes=window)
    for step in range(4):
        _step(ref, ref_opt, step)
        with offload.stepping():
            _step(off, off_opt, step)
        assert "step" not in off_opt.__dict__  # the torch optimizer's own step() is back
        for a, b in zip(ref.parameters(), off.parameters()):
            assert torch.equal(a, b), step
        assert offload.offloaded and all(off_opt.state[p]["exp_avg"] is None for p in off.parameters())
        if step:  # the first step made the state: it ran whole, then went to disk
            largest = max(2 * p.numel() * 4 for p in off.parameters())
            assert largest <= offload.held_peak <= max(window, largest) + 2 * 4096, offload.held_peak
            if window > largest:  # room for more than one parameter: the next ones were read ahead
                assert offload.held_peak > largest
    offload.load()
    for p, q in zip(ref.parameters(), off.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ref_opt.state[p][key], off_opt.state[q][key])


@pytest.mark.parametrize("kept_params", [1, 2])  # two: a kept parameter steps after the window blocked reads
def test_kept_moments_stay_in_memory_and_the_streamed_steps_stay_the_resident_ones(tmp_path, caplog, kept_params):
    """trainer.optimizer_offload_keep_mb: the first parameters' moments in stepping order (whole) stay
    in memory and step in place; the rest stream from the file; four steps equal torch's resident
    AdamW bit for bit, without the whole-state fallback, and a checkpoint-style load/store keeps the
    same split."""
    big = 1 << 22  # the embedding's moments: 32 MiB; the linears' a few KB
    ref, off = _model(0, big), _model(0, big)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    off_opt = torch.optim.AdamW(off.parameters(), lr=1e-2, weight_decay=0.1)
    params = list(off.parameters())
    keep = sum(2 * p.numel() * 4 for p in params[:kept_params])
    offload = OptimizerStateOffload(_Wrapped(off_opt), tmp_path / "state.bin", window_bytes=1, keep_bytes=keep)
    for step in range(4):
        _step(ref, ref_opt, step)
        with caplog.at_level(logging.WARNING, logger=offload_mod.__name__), offload.stepping():
            _step(off, off_opt, step)
        for a, b in zip(ref.parameters(), off.parameters()):
            assert torch.equal(a, b), step
        assert offload.kept_bytes == keep
        assert all(off_opt.state[p]["exp_avg"] is not None for p in params[:kept_params])  # kept
        assert all(off_opt.state[p]["exp_avg"] is None for p in params[kept_params:])  # on disk
        assert 0 < offload.bytes < keep / 100  # the file holds only the small ones
    assert "holds them all" not in caplog.text  # every streamed step ran streamed
    with offload.resident():  # a checkpoint's save: everything in memory, then the same split again
        assert all(off_opt.state[p]["exp_avg"] is not None for p in params)
    assert off_opt.state[params[0]]["exp_avg"] is not None and off_opt.state[params[-1]]["exp_avg"] is None
    offload.load()
    for p, q in zip(ref.parameters(), off.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ref_opt.state[p][key], off_opt.state[q][key])


def test_a_parameter_without_state_on_file_steps_whole(tmp_path, caplog):
    """A parameter that gets its first grad after the state went to disk (its moments are made by this
    step): the step runs resident, with the same bits, says so, and the new moments go to the file too."""
    ref, off = _model(4, 1 << 12), _model(4, 1 << 12)
    ref_opt, off_opt = torch.optim.Adam(ref.parameters(), lr=1e-2), torch.optim.Adam(off.parameters(), lr=1e-2)
    for m in (ref, off):
        m[2].requires_grad_(False)
    offload = OptimizerStateOffload(_Wrapped(off_opt), tmp_path / "state.bin")
    for step in range(3):
        if step == 2:
            for m in (ref, off):
                m[2].requires_grad_(True)
        _step(ref, ref_opt, step)
        with caplog.at_level(logging.WARNING), offload.stepping():
            _step(off, off_opt, step)
        assert ("holds them all" in caplog.text) == (step == 2), step
        for a, b in zip(ref.parameters(), off.parameters()):
            assert torch.equal(a, b), step
    assert all(off_opt.state[p]["exp_avg"] is None for p in off.parameters())  # all on disk, the new ones too


def test_store_twice_is_refused_and_buffered_io_gives_the_same_bits(tmp_path):
    model = _model(1, 1 << 12)
    opt = torch.optim.Adam(model.parameters())
    _step(model, opt, 0)
    moments = ("exp_avg", "exp_avg_sq")
    want = {(i, k): opt.state[p][k].clone() for i, p in enumerate(model.parameters()) for k in moments}
    offload = OptimizerStateOffload(_Wrapped(opt), tmp_path / "s.bin")
    offload._direct = False  # the route for filesystems that refuse O_DIRECT
    offload.store()
    with pytest.raises(RuntimeError, match="store\\(\\) twice"):
        offload.store()
    offload.load()
    for (i, k), t in want.items():
        assert torch.equal(opt.state[list(model.parameters())[i]][k], t)


def test_an_offload_to_a_memory_filesystem_says_it_saves_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(offload_mod, "filesystem_type", lambda path: "tmpfs")
    with caplog.at_level(logging.WARNING):
        OptimizerStateOffload(_Wrapped(torch.optim.Adam(_model(2, 1 << 12).parameters())), tmp_path / "s.bin")
    assert "saves no memory" in caplog.text and str(tmp_path) in caplog.text


def test_filesystem_type_reads_the_longest_mount():
    assert offload_mod.filesystem_type("/proc/self") == "proc"
    assert offload_mod.filesystem_type("/") != "unknown"


def test_an_actor_with_its_moments_on_disk_trains_and_resumes_as_the_resident_one(tmp_path):
    """Megatron's optimizer (bf16 params, fp32 main params and Adam state): three steps with the
    moments offloaded between them give the resident actor's logprobs bit for bit; a checkpoint saved
    with them on disk and loaded into a fresh offloading actor continues as the resident one."""
    from megatron_trace.config import AlgoConfig, TrainerConfig
    from megatron_trace.models import ModelArch, QuantPolicy, make_tiny_checkpoint
    from megatron_trace.rl import Sample
    from megatron_trace.trainer.actor import Actor
    from megatron_trace.trainer.parallel import destroy, init_distributed

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "qwen2", seed=3)
    init_distributed()
    try:
        arch = ModelArch.from_hf_config(ckpt)
        g = torch.Generator().manual_seed(0)
        batch = []
        for i, (p, r) in enumerate([(5, 7), (3, 9), (8, 4), (6, 6)]):
            ids = torch.randint(0, arch.vocab_size, (p + r,), generator=g).tolist()
            batch.append(Sample(f"s{i}", ids[:p], ids[p:], [-2.0] * r, advantage=(-1.0) ** i))

        def actor(offload: bool, where: str) -> Actor:
            cfg = TrainerConfig(
                qat_mode="rtn", lr=1e-3, dtype="bfloat16", optimizer_offload="disk" if offload else "none"
            )
            return Actor(arch, QuantPolicy(kv="nvfp4"), cfg, hf_path=ckpt, offload_dir=tmp_path / where)

        def on_policy(reference: Actor) -> list[Sample]:  # a rollout of the current weights: no step clipped
            for s, lp in zip(batch, reference.compute_logprobs(batch)):
                s.rollout_logprobs = [float(x) + 0.01 for x in lp]
            return batch

        resident, offloaded = actor(False, "a"), actor(True, "b")
        for step in range(3):
            on_policy(resident)
            a, b = resident.train_step(batch, AlgoConfig()), offloaded.train_step(batch, AlgoConfig())
            assert a.metrics["grad_norm"] > 0 and a.metrics["grad_norm"] == b.metrics["grad_norm"], step
            assert "optimizer_offload" in b.times and "optimizer_offload" not in a.times
            assert offloaded.offload.offloaded
            # the first step made the state (whole); the later ones streamed it a parameter at a time
            assert (offloaded.offload.held_peak > 0) == (step > 0)
        for x, y in zip(resident.compute_logprobs(batch), offloaded.compute_logprobs(batch)):
            assert torch.equal(x, y)
        offloaded.save_checkpoint(tmp_path / "ckpts", step=2, extra={"version": 3})
        assert offloaded.offload.offloaded  # the save read them back and wrote them out again
        offloaded.finish_training()
        assert not (tmp_path / "b" / "optimizer_state.rank0.bin").exists()
        fresh = actor(True, "c")
        fresh.load_checkpoint(tmp_path / "ckpts")
        assert fresh.offload.offloaded  # loaded, then to disk until its first step
        on_policy(resident)
        a, c = resident.train_step(batch, AlgoConfig()), fresh.train_step(batch, AlgoConfig())
        assert a.metrics["grad_norm"] == c.metrics["grad_norm"]
        for x, y in zip(resident.compute_logprobs(batch), fresh.compute_logprobs(batch)):
            assert torch.equal(x, y)
    finally:
        destroy()


def test_a_cuda_trainer_is_refused_before_anything_is_built(monkeypatch):
    from megatron_trace.config import TrainerConfig
    from megatron_trace.trainer.actor import Actor

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"optimizer_offload=disk .* trainer\.distributed_optimizer=true"):
        Actor(None, None, TrainerConfig(optimizer_offload="disk"))


def test_the_offload_benchmark_runs(tmp_path, capsys):
    from benchmarks.optimizer_offload import main

    assert main(["--dir", str(tmp_path), "--layers", "1", "--vocab", "64", "--rounds", "2", "--keep-mb", "1"]) == 0
    out = capsys.readouterr().out
    assert "round 1: resident" in out and "streamed" in out and "GiB/s" in out and not list(tmp_path.iterdir())
    assert "streamed, kept" in out and "kept 0 MiB" not in out  # the embedding's 64 x 896 moments fit 1 MiB
