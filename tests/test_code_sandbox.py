"""data/sandbox.py: model-written code runs contained (bubblewrap by default), and a hostile program
ends with a status, never an exception, a stalled run or a touched host."""

import json
import os
import secrets
import signal
import socket
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_trace.data.sandbox import TAIL_BYTES, Sandbox, SandboxUnavailable

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def box():
    return Sandbox(timeout_s=20.0, workers=2)


@pytest.fixture(scope="module")
def weak():
    return Sandbox("rlimits", timeout_s=20.0, workers=2)


def _procs_with(marker: str) -> list[int]:
    """Host processes whose command line holds `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def _marker() -> str:
    """A `sleep` argument no other process has."""
    return f"{secrets.randbelow(10**6) + 10**6}.{secrets.randbelow(10**6)}"


def _src(text: str) -> str:
    return textwrap.dedent(text).strip() + "\n"


# ------------------------------------------------------------------ what counts as a pass


def test_pass_needs_the_program_to_reach_its_end(box):
    results = box.run_many(
        [
            "print('hello')\nassert sum([1, 2]) == 3",
            "assert 1 + 1 == 3",
            "import sys\nsys.exit(0)\nassert False",
            "import os\nos._exit(0)\nassert False",
            "raise SystemExit\nassert False",
            "import sys\nsys.exit(3)",
            "def broken(:\n    pass",
            *[f"print({i})" for i in range(4)],
        ]
    )
    assert [r.status for r in results] == ["passed", "failed"] + ["no_sentinel"] * 3 + ["failed"] * 2 + ["passed"] * 4
    assert results[0].stdout_tail == "hello\n"  # the sentinel is never shown
    assert "AssertionError" in results[1].stderr_tail and "SyntaxError" in results[6].stderr_tail
    assert [r.stdout_tail for r in results[7:]] == [f"{i}\n" for i in range(4)]  # input order
    assert {r.isolation for r in results} == {"bwrap"}


def test_the_program_cannot_read_the_sentinel(box):
    """The token comes on stdin, read before the program starts: stdin is then empty and the
    environment holds nothing of it."""
    r = box.run(
        _src(
            """
            import os, sys
            print(repr(sys.stdin.read()), sorted(os.environ))
            print(open("/proc/self/environ", "rb").read())
            """
        )
    )
    assert r.status == "passed"
    first, environ = r.stdout_tail.splitlines()
    assert first == "'' ['HOME', 'LANG', 'OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'PATH', 'PWD']"
    assert "SANDBOX" not in environ and "token" not in environ.lower()


# ------------------------------------------------------------------ hostile programs


def test_infinite_loop_and_sleep_time_out_and_leave_nothing_behind():
    short = Sandbox(timeout_s=1.0, workers=3)
    marker = _marker()
    sleeper = f"import subprocess, time\nsubprocess.Popen(['sleep', '{marker}'])\ntime.sleep(1000)"
    results = short.run_many(["while True:\n    pass", "import time\ntime.sleep(1000)", sleeper])
    assert [r.status for r in results] == ["timeout"] * 3
    assert all(r.wall_s < 15 for r in results)
    assert _procs_with(marker) == []  # killed with the namespace before run returned


def test_cpu_limit_ends_a_busy_loop_before_the_wall_clock():
    boxes = [Sandbox(mode, timeout_s=60.0, cpu_s=1) for mode in ("bwrap", "rlimits")]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda b: b.run("while True:\n    pass"), boxes))
    assert [r.status for r in results] == ["timeout", "timeout"]
    # bwrap's pid-1 harness ignores SIGXCPU, so its hard limit's SIGKILL ends it a second later
    assert [r.returncode for r in results] == [128 + signal.SIGKILL, 128 + signal.SIGXCPU]


def test_fork_bomb_is_capped_and_dies_with_the_run():
    tag = 1_000_000 + secrets.randbelow(10**5)  # its output limit: in every harness process's command line
    bomb = Sandbox(timeout_s=2.0, max_procs=16, output_bytes=tag)
    r = bomb.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert r.status == "timeout"
    assert _procs_with(f"\0{tag}\0") == []


def test_forks_stop_at_the_process_limit_and_children_die(box):
    marker = _marker()
    r = box.run(
        _src(
            f"""
            import subprocess
            n = 0
            try:
                while n < 1000:
                    subprocess.Popen(["sleep", "{marker}"])
                    n += 1
            except OSError as e:
                print(n, e.errno)
            """
        )
    )
    assert r.status == "passed"
    n, errno = map(int, r.stdout_tail.split())
    assert n < 16 and errno == 11  # EAGAIN: RLIMIT_NPROC (bwrap's init and the harness count too)
    assert _procs_with(marker) == []


@pytest.mark.parametrize(
    "source",
    [
        "x = bytearray(8 << 30)",
        "x = []\nwhile True:\n    x.append(bytearray(64 << 20))",
        "x = [0] * (10**9)",
    ],
)
def test_memory_bombs_hit_the_address_space_limit(box, source):
    assert box.run(source).status == "oom"


def test_host_files_are_out_of_reach(box, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    before = secret.stat()
    marker = f"sandbox-{secrets.token_hex(4)}"
    targets = [str(secret), str(REPO / "setup.py"), "/root", "/home", "/work", "/etc/passwd", "/etc/shadow"]
    r = box.run(
        _src(
            f"""
            import json, os
            got = {{}}
            for path in {targets!r}:
                try:
                    got[path] = os.listdir(path) if os.path.isdir(path) else open(path).read(10)
                except OSError as e:
                    got[path] = type(e).__name__
            for path in ({str(secret)!r}, "/usr/lib/{marker}", "/{marker}", "/tmp/{marker}"):
                try:
                    open(path, "w").write("overwritten")
                    got["wrote " + path] = True
                except OSError as e:
                    got["wrote " + path] = type(e).__name__
            got["/"] = sorted(os.listdir("/"))
            got["cwd"] = os.getcwd()
            print(json.dumps(got))
            """
        )
    )
    assert r.status == "passed", r.stderr_tail
    got = json.loads(r.stdout_tail)
    assert all(got[p] == "FileNotFoundError" for p in targets), got
    assert got[f"wrote {secret}"] == "FileNotFoundError"
    assert got[f"wrote /usr/lib/{marker}"] in ("OSError", "PermissionError")  # a read-only bind
    assert got[f"wrote /{marker}"] in ("OSError", "PermissionError")  # the sandbox's root is read-only
    assert got[f"wrote /tmp/{marker}"] is True and got["cwd"] == "/tmp"  # its own scratch
    assert set(got["/"]) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr"}
    assert secret.read_text() == "do not read" and secret.stat().st_mtime_ns == before.st_mtime_ns
    assert not Path(f"/tmp/{marker}").exists() and not Path(f"/usr/lib/{marker}").exists()


def test_no_network_even_to_the_hosts_loopback(box):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        port = server.getsockname()[1]
        r = box.run(
            _src(
                f"""
                import socket
                for addr in (("127.0.0.1", {port}), ("1.1.1.1", 53)):
                    try:
                        socket.create_connection(addr, timeout=3).close()
                        print("connected", addr)
                    except OSError as e:
                        print(type(e).__name__)
                """
            )
        )
        assert r.status == "passed" and "connected" not in r.stdout_tail, r.stdout_tail
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever reached the host's listener


def test_background_children_and_daemons_die_with_the_run(box):
    marker = _marker()
    r = box.run(
        _src(
            f"""
            import os, subprocess
            subprocess.Popen(["sleep", "{marker}"])
            if os.fork() == 0:  # a double-forked daemon in its own session
                os.setsid()
                if os.fork() == 0:
                    os.execv("/usr/bin/sleep", ["sleep", "{marker}"])
                os._exit(0)
            print("spawned")
            """
        )
    )
    assert r.status == "passed"
    assert _procs_with(marker) == []


def test_killing_its_parent_or_init_leaves_the_host_alive(box):
    r = box.run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(1, signal.SIGKILL)\nprint('on')")
    assert r.status in ("passed", "crash", "failed")
    os.kill(os.getpid(), 0)  # this process lives
    assert box.run("print(1)").status == "passed"  # and the sandbox still works


def test_huge_output_is_capped_not_buffered():
    small = Sandbox(timeout_s=20.0, output_bytes=1 << 16)
    out, err = small.run_many(
        [
            "import sys\nwhile True:\n    sys.stdout.write('x' * 4096)",
            "import sys\nwhile True:\n    sys.stderr.write('y' * 4096)",
        ]
    )
    assert out.status == "output_limit" and len(out.stdout_tail) <= TAIL_BYTES and out.wall_s < 15
    assert err.status in ("output_limit", "failed") and len(err.stderr_tail) <= TAIL_BYTES


# ------------------------------------------------------------------ the opt-in weaker mode


def test_rlimits_mode_limits_and_reaps_but_says_it_is_weaker(weak):
    marker = _marker()
    results = weak.run_many(
        [
            "print('ok')",
            "import sys\nsys.exit(0)\nassert False",
            "x = bytearray(8 << 30)",
            f"import os, subprocess\nsubprocess.Popen(['sleep', '{marker}'])\n"
            f"if os.fork() == 0:\n    os.setsid()\n    os.execv('/usr/bin/sleep', ['sleep', '{marker}'])",
            "import os\nprint(sorted(os.environ), os.getcwd().startswith('/tmp/sandbox-'))",
        ]
    )
    assert [r.status for r in results] == ["passed", "no_sentinel", "oom", "passed", "passed"]
    assert {r.isolation for r in results} == {"rlimits"}
    assert _procs_with(marker) == []  # the reaper killed the child and the daemon
    env = "['HOME', 'LANG', 'OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'PATH']"
    assert results[4].stdout_tail.strip() == f"{env} True"


@pytest.mark.skipif(os.geteuid() != 0, reason="a non-root host's rlimits-mode program may signal the host")
def test_rlimits_mode_on_a_root_host_cannot_kill_the_host(weak):
    r = weak.run(f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)")
    assert r.status == "failed" and "PermissionError" in r.stderr_tail  # it runs as nobody
    os.kill(os.getpid(), 0)


def test_rlimits_mode_times_out():
    assert Sandbox("rlimits", timeout_s=1.0).run("while True:\n    pass").status == "timeout"


# ------------------------------------------------------------------ an unavailable sandbox says so


def test_missing_bwrap_is_an_error_at_construction_naming_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(
        SandboxUnavailable, match=r"bubblewrap \(bwrap\) is not installed.*apt-get install bubblewrap.*'rlimits'"
    ):
        Sandbox(python="/usr/bin/python3")


def test_bwrap_without_namespaces_is_an_error_at_construction(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(SandboxUnavailable, match=r"cannot run a sandbox here \(sandbox_error.*namespace.*'rlimits'"):
        Sandbox(timeout_s=3.0)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="bwrap, rlimits"):
        Sandbox("docker")
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        Sandbox("rlimits", timeout_s=0)
    with pytest.raises(ValueError, match="not an executable"):
        Sandbox("rlimits", python="/nonexistent/python")
