"""The one place model-written code runs: `Sandbox(...).run(source) -> RunResult`.

Default mode "bwrap" (bubblewrap): the program sees a read-only /usr (the interpreter and its
libraries), its own /proc, a minimal /dev and size-capped private tmpfs /tmp and /dev/shm, and
nothing else of the host: no repo, checkpoints, configs, run dirs, /root, /home or /etc. It has no
network (its own empty network namespace), runs as an unprivileged user (root hosts drop to
`nobody` first: the kernel exempts root from the process limit), and is the init of its own pid
namespace: when it exits (or, at the wall-clock timeout, is killed) the kernel kills every process
it started, daemons included, before bwrap returns. Inside, the harness sets hard limits on CPU
time, address space, processes (threads count), file size (stdout and stderr are files on the
host, so a flood of output costs disk up to that size, never memory) and core dumps before the
program runs.

Mode "rlimits" is the weaker opt-in for hosts without bubblewrap: the same harness and limits, a
private temp cwd, a stripped environment, `nobody` on a root host, a reaper that kills what the
program left behind, but no filesystem, network or pid isolation (a non-root host's program can
signal the host's processes; one that leaves the session and kills the reaper can outlive the run).
Every result says which isolation produced it (`RunResult.isolation`), so a caller can log it.

"passed" needs proof that the program ran to its end: the host hands the harness a random token on
stdin, which the harness reads (then points stdin at /dev/null) before the program starts and prints
after it returns. `sys.exit(0)` / `os._exit(0)` before the tests exit 0 without it ("no_sentinel").
The token lives in the harness's memory while the program runs: a program that searches the
interpreter (frames, gc) for it could forge a pass. The sentinel stops early exits, not that.
"""

from __future__ import annotations

import math
import os
import secrets
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

MODES = ("bwrap", "rlimits")
STATUSES = ("passed", "failed", "no_sentinel", "timeout", "oom", "crash", "output_limit", "sandbox_error")
NOBODY = 65534  # the uid/gid a root host runs programs as
TAIL_BYTES = 4096  # of stdout and stderr kept in a RunResult

# Runs as `python -I -c HARNESS cpu_s memory_bytes max_procs output_bytes reaper`: stdlib only and
# Python-3.8 syntax, since it runs in whatever interpreter the sandbox was given.
HARNESS = r"""
import os, resource, sys


def _tasks_of(uid):
    n = 0
    for pid in os.listdir("/proc"):
        try:
            with open("/proc/%s/status" % pid) as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                n += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            pass
    return n


def _limit(cpu, mem, procs, fsize, reaper):
    if reaper:  # no user namespace: the process limit counts every task of this uid on the host
        procs += _tasks_of(os.getuid())
    for what, soft, hard in (
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_AS, mem, mem),
        (resource.RLIMIT_NPROC, procs, procs),
        (resource.RLIMIT_FSIZE, fsize, fsize),
        (resource.RLIMIT_CORE, 0, 0),
    ):
        resource.setrlimit(what, (soft, hard))


def _reap(child):
    import signal

    _, status = os.waitpid(child, 0)
    me = os.getpid()
    while True:  # orphans reparent to us as their parents die: until none is left
        try:
            with open("/proc/%d/task/%d/children" % (me, me)) as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        if not kids:
            break
        for k in kids:
            try:
                os.kill(k, signal.SIGKILL)
            except OSError:
                pass
        for k in kids:
            try:
                os.waitpid(k, 0)
            except ChildProcessError:
                pass
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


def _main():
    cpu, mem, procs, fsize, reaper = map(int, sys.argv[1:6])
    token, _, src = sys.stdin.buffer.read().partition(b"\n")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    _limit(cpu, mem, procs, fsize, reaper)
    if reaper:
        import ctypes

        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come to us
        child = os.fork()
        if child:
            _reap(child)
    sys.argv = ["answer.py"]
    code = compile(src, "answer.py", "exec")
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    sys.stdout.flush()
    os.write(1, b"\n" + token + b"\n")


_main()
"""


class SandboxUnavailable(RuntimeError):
    """The requested isolation cannot run on this host (said at construction, never at a run)."""


@dataclass
class RunResult:
    status: str  # one of STATUSES
    stdout_tail: str  # the last TAIL_BYTES of stdout, the sentinel removed
    stderr_tail: str
    wall_s: float
    isolation: str  # the mode that ran it: "bwrap" or "rlimits"
    returncode: int | None = None

    @property
    def passed(self) -> bool:
        return self.status == "passed"


_probed: set[tuple[str, ...]] = set()
_probe_lock = threading.Lock()


class Sandbox:
    """Runs Python sources under `mode`'s isolation with these limits (see the module docstring).

    `python` is the interpreter run inside, resolved on the host to its real path (a virtualenv's
    python runs as its base interpreter; the venv, often inside a repo, is not bound). Outside /usr,
    its base prefix is bound read-only too, and must be readable by `nobody` on a root host.
    A limit bounds each process: a program's processes together may hold up to
    max_procs x memory_mb of address space.
    """

    def __init__(
        self,
        mode: str = "bwrap",
        *,
        timeout_s: float = 10.0,
        cpu_s: int | None = None,
        memory_mb: int = 1024,
        max_procs: int = 16,
        output_bytes: int = 1 << 20,
        tmp_mb: int = 64,
        python: str = "/usr/bin/python3",
        workers: int = 4,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"sandbox mode must be one of {', '.join(MODES)}; got {mode!r}")
        for name, value in (
            ("timeout_s", timeout_s),
            ("cpu_s", 1 if cpu_s is None else cpu_s),
            ("memory_mb", memory_mb),
            ("max_procs", max_procs),
            ("output_bytes", output_bytes),
            ("tmp_mb", tmp_mb),
            ("workers", workers),
        ):
            if not value > 0:
                raise ValueError(f"sandbox {name} must be > 0; got {value}")
        self.mode, self.isolation, self.timeout_s, self.workers = mode, mode, float(timeout_s), int(workers)
        cpu_s = (
            math.ceil(timeout_s) if cpu_s is None else cpu_s
        )  # by default the wall clock, not the CPU limit, ends a busy loop
        self.limits = (int(cpu_s), int(memory_mb) << 20, int(max_procs), int(output_bytes))
        self.tmp_bytes = int(tmp_mb) << 20
        self.python, self.binds = _interpreter(python)
        self._user = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}
        self.bwrap = shutil.which("bwrap") if mode == "bwrap" else None
        if mode == "bwrap":
            self._probe()

    # -------------------------------------------------------------------------------- command line

    def _argv(self) -> list[str]:
        harness = [self.python, "-I", "-c", HARNESS, *map(str, self.limits), str(int(self.mode == "rlimits"))]
        if self.mode == "rlimits":
            return harness
        argv = [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv"]
        for key, value in _ENV.items():
            argv += ["--setenv", key, value]
        argv += ["--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):  # merged-/usr links or real dirs
            if os.path.islink(top):
                argv += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                argv += ["--ro-bind", top, top]
        if os.path.isfile("/etc/ld.so.cache"):  # where the dynamic loader finds shared libraries
            argv += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        for path in self.binds:
            argv += ["--ro-bind", path, path]
        argv += ["--proc", "/proc", "--dev", "/dev"]
        argv += ["--size", str(self.tmp_bytes), "--tmpfs", "/tmp", "--size", str(self.tmp_bytes), "--tmpfs", "/dev/shm"]
        argv += ["--chdir", "/tmp", "--remount-ro", "/", "--as-pid-1", "--", *harness]
        return argv

    def _probe(self) -> None:
        """One real run of an empty program per distinct command line: a host without bubblewrap,
        or whose kernel refuses it namespaces, fails here and says so."""
        if self.bwrap is None:
            raise SandboxUnavailable(
                "bubblewrap (bwrap) is not installed, and model-written code runs only inside it: install it "
                "(apt-get install bubblewrap), or opt in to the weaker sandbox mode 'rlimits' (resource limits "
                "only: no filesystem or network isolation)"
            )
        key = tuple(self._argv()) + (str(self._user),)
        with _probe_lock:
            if key in _probed:
                return
            r = self.run("", timeout_s=max(self.timeout_s, 30.0))
            if not r.passed:
                raise SandboxUnavailable(
                    f"bubblewrap (bwrap) cannot run a sandbox here ({r.status}: {r.stderr_tail.strip()[-500:]!r}); "
                    "it needs unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
                    "user.max_user_namespaces > 0), or opt in to the weaker sandbox mode 'rlimits' (resource "
                    "limits only: no filesystem or network isolation)"
                )
            _probed.add(key)

    # -------------------------------------------------------------------------------- running

    def run(self, source: str, timeout_s: float | None = None) -> RunResult:
        """Run one program to its end, its timeout (default: the sandbox's) or a limit; never raises for
        what the program does."""
        token = secrets.token_hex(16).encode()
        with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            stdin.write(token + b"\n" + source.encode("utf-8", "surrogatepass"))
            stdin.seek(0)
            cwd = tempfile.mkdtemp(prefix="sandbox-") if self.mode == "rlimits" else "/"
            try:
                if cwd != "/" and self._user:
                    os.chown(cwd, NOBODY, NOBODY)
                start = time.monotonic()
                try:
                    rc, timed_out = self._spawn(stdin, out, err, cwd, timeout_s or self.timeout_s)
                except OSError as e:
                    return RunResult("sandbox_error", "", f"{type(e).__name__}: {e}", 0.0, self.isolation)
                wall = time.monotonic() - start
            finally:
                if cwd != "/":
                    shutil.rmtree(cwd, ignore_errors=True)
            stdout, stderr = _tail(out), _tail(err)
        seen = token in stdout
        stdout = stdout.replace(b"\n" + token + b"\n", b"")
        status = self._status(rc, timed_out, seen, stderr)
        return RunResult(status, _text(stdout), _text(stderr), wall, self.isolation, rc)

    def _spawn(self, stdin, out, err, cwd: str, timeout_s: float) -> tuple[int, bool]:
        """(exit code, timed out). The leader stays unreaped until its group is killed, so the
        group id cannot name another process by then."""
        env = dict(_ENV, HOME=cwd) if self.mode == "rlimits" else {"PATH": _ENV["PATH"]}
        proc = subprocess.Popen(
            self._argv(), stdin=stdin, stdout=out, stderr=err, cwd=cwd, env=env, start_new_session=True, **self._user
        )
        try:
            pidfd = os.pidfd_open(proc.pid)
            try:
                timed_out = not select.select([pidfd], [], [], timeout_s)[0]
                if timed_out and self.mode == "bwrap":
                    _kill_init(proc.pid)
                    select.select([pidfd], [], [], 30.0)  # bwrap exits once the namespace is empty
            finally:
                os.close(pidfd)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        return proc.returncode, timed_out

    def _status(self, rc: int, timed_out: bool, seen: bool, stderr: bytes) -> str:
        if timed_out:
            return "timeout"
        sig = rc - 128 if rc > 128 else -rc if rc < 0 else None  # the harness and bwrap report 128 + signal
        if sig in (signal.SIGXCPU, signal.SIGKILL):  # the CPU limit's (a pid namespace's init ignores SIGXCPU,
            return "timeout"  # so there its hard limit's SIGKILL a second later ends it)
        if sig == signal.SIGXFSZ:
            return "output_limit"
        if rc == 0:
            return "passed" if seen else "no_sentinel"
        if self.mode == "bwrap" and rc == 1 and stderr.startswith(b"bwrap: "):
            return "sandbox_error"
        if b"MemoryError" in stderr[-1024:]:
            return "oom"
        if b"[Errno 27] File too large" in stderr[-1024:]:  # Python ignores SIGXFSZ: the write fails instead
            return "output_limit"
        return "crash" if sig is not None else "failed"

    def run_many(self, sources: list[str], workers: int | None = None) -> list[RunResult]:
        """`run` over `sources` on up to `workers` (default: the sandbox's) at once, in input order."""
        n = min(workers or self.workers, len(sources))
        if n <= 1:
            return [self.run(s) for s in sources]
        with ThreadPoolExecutor(n, thread_name_prefix="sandbox") as pool:
            return list(pool.map(self.run, sources))


_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def _interpreter(python: str) -> tuple[str, list[str]]:
    """(the interpreter's real path, the directories beyond /usr it needs bound read-only)."""
    found = shutil.which(python)
    if found is None:
        raise ValueError(f"sandbox python {python!r} is not an executable file or on PATH")
    real = os.path.realpath(found)
    if real.startswith("/usr/"):
        return real, []
    # A config-chosen interpreter (trusted, like the host's own) says where its stdlib lives.
    out = subprocess.run(
        [real, "-I", "-c", "import sys; print(sys.base_prefix); print(sys.base_exec_prefix)"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    binds = sorted({os.path.realpath(p) for p in out} | {os.path.dirname(real)})
    binds = [p for p in binds if not p.startswith("/usr/")]
    for p in binds:
        if p.count("/") < 2:
            raise ValueError(f"sandbox python {python!r} lives in {p!r}: binding that would expose the host")
    # nested directories bind once, under the outermost
    return real, [p for p in binds if not any(p.startswith(q + "/") for q in binds)]


def _kill_init(bwrap_pid: int) -> None:
    """SIGKILL bwrap's one child, the sandbox's pid-1 harness: the kernel ends its exit only when
    every process of its namespace is gone (killing bwrap instead would leave that to bwrap's
    asynchronous die-with-parent). The pidfd pins the process, and its parent, checked after
    opening it, shows the pid was not reused."""
    try:
        with open(f"/proc/{bwrap_pid}/task/{bwrap_pid}/children") as f:
            kids = [int(k) for k in f.read().split()]
    except OSError:
        return
    for kid in kids:
        try:
            fd = os.pidfd_open(kid)
        except OSError:
            continue
        try:
            with open(f"/proc/{kid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == bwrap_pid:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass
        finally:
            os.close(fd)


def _tail(f) -> bytes:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - TAIL_BYTES - 64))  # the sentinel line is 34 bytes
    return f.read()


def _text(b: bytes) -> str:
    return b[-TAIL_BYTES:].decode("utf-8", "replace")


__all__ = ["HARNESS", "MODES", "STATUSES", "RunResult", "Sandbox", "SandboxUnavailable"]
