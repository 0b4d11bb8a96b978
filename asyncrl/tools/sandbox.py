"""Run model-written Python in a sandbox: one fresh, locked-down interpreter process per call.

Each call is a new `python -I -S sandbox_runner.py` (the child side, stdlib only) in its own session and its own
temp dir. Inside, before the code runs: rlimits (CPU, address space, file size, open files, no new processes),
a drop to uid/gid 65534 when we are root, Landlock (no files outside the temp dir but the stdlib, read-only; no
TCP; no signals out), and a seccomp filter (no fork, exec or sockets). Here, the parent enforces the wall-clock
limit and the output cap, and in every case kills the child's whole process group and reaps it before the call
returns: no process outlives its call. The temp dir's removal never raises and takes at most CLEANUP_S in the
call; what code that made too many files to remove by then leaves is removed by a background thread.

Memory beside the address-space cap: RLIMIT_AS counts mappings, not the pages of a memfd, /dev/shm or POSIX
message queue, so the seccomp filter refuses memfd_create and mq_open and Landlock keeps /dev/shm out. (Measuring
RSS + shmem and killing would be racy and miss unmapped memfd pages; a cgroup is not ours to make everywhere.)

Nothing the code does makes `run` raise: every failure is a `ToolResult` with `ok=False`, an `error` kind and a
short text for the model to read. Kinds: 'timeout', 'cpu_limit', 'memory', 'output_limit', 'exception',
'forbidden' (a blocked syscall or path: EPERM/EACCES), 'sandbox' (the sandbox itself failed, or a required
kernel layer is missing here).

Without Landlock or seccomp (an old kernel, a laptop) `require_kernel_layers=False` runs the code behind Python
audit hooks instead: that stops honest mistakes, not a hostile program.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass

from asyncrl.tools import sandbox_runner as runner

logger = logging.getLogger(__name__)

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_runner.py")
NOBODY = 65534  # the uid/gid a root parent's calls run as
OUTPUT_HEAD = 512  # characters of the output kept in an output_limit error: enough to see what was printed
READ_CHUNK = 1 << 16
CLEANUP_S = 0.5  # a call's own cleanup stops after this; the rest of its temp dir is removed in the background
SIGNAL_NAMES = {int(s): s.name for s in signal.Signals}


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 5.0  # wall-clock timeout per call
    cpu_s: int = 4  # RLIMIT_CPU
    memory_mb: int = 512  # RLIMIT_AS headroom (address space cap)
    output_bytes: int = 16384  # stdout+stderr cap; beyond -> error
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE
    open_files: int = 64  # RLIMIT_NOFILE


@dataclass(frozen=True)
class ToolResult:
    ok: bool
    output: str  # stdout (then stderr); when not ok, ends with a short error text for the model
    error: str | None  # None, or a kind: see the module docstring
    latency_s: float


@dataclass
class _Run:
    """What the parent saw of one child."""

    out: bytes
    err: bytes
    killed: str | None  # 'timeout' or 'output_limit' when the parent killed it for that
    status: int  # as os.waitstatus_to_exitcode: >= 0 an exit code, < 0 a signal
    cpu_s: float
    started: bool  # the child reported its setup done and the code started


class PythonSandbox:
    """Runs code in the sandbox; `submit` runs up to `workers` calls at once in a thread pool (each call is its own
    process), so tool calls overlap with decoding. `on_spawn` is called with each child's pid (tests use it to
    check that no process outlives its call)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), workers: int = 4, require_kernel_layers: bool = True,
                 *, kernel_layers: bool = True, on_spawn: Callable[[int], None] | None = None) -> None:
        """`kernel_layers=False` skips Landlock and seccomp even where they exist and runs on the audit-hook layer
        alone, as a machine without them would (to test that fallback; it needs `require_kernel_layers=False`)."""
        if not kernel_layers and require_kernel_layers:
            raise ValueError("kernel_layers=False needs require_kernel_layers=False")
        self.limits = limits
        self.require_kernel_layers = require_kernel_layers
        self.kernel_layers = kernel_layers
        self.on_spawn = on_spawn
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tool-sandbox")
        # One thread finishes the temp dirs that a call could not remove within CLEANUP_S (code that made more
        # files than a bounded cleanup removes): the call returns on time, and the files still go.
        self._reaper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tool-sandbox-cleanup")
        self._reaping: set[Future[None]] = set()
        self._reaping_lock = threading.Lock()

    def run(self, code: str) -> ToolResult:
        """Runs `code` to completion or to a limit. Blocking; never raises for anything the code does."""
        t0 = time.monotonic()
        if not isinstance(code, str):
            return ToolResult(False, f"Error (exception): the code must be a string, not {type(code).__name__}",
                              "exception", 0.0)
        workdir = None
        try:
            workdir = tempfile.mkdtemp(prefix="asyncrl-tool-")
            ok, text, error = _interpret(self._execute(code, workdir), self.limits)
        except Exception as e:  # the sandbox's own failure (spawn, temp dir, ...): the model reads it, we log it
            logger.exception("tool sandbox call failed")
            ok, text, error = False, f"Error (sandbox): {type(e).__name__}: {e}", "sandbox"
        finally:
            if workdir is not None:
                self._cleanup(workdir)
        return ToolResult(ok, text, error, time.monotonic() - t0)

    def submit(self, code: str) -> Future[ToolResult]:
        return self._pool.submit(self.run, code)

    def wait_for_cleanup(self, timeout: float | None = None) -> bool:
        """Waits until the temp dirs handed to the background are removed; False if some are not, at `timeout`."""
        with self._reaping_lock:
            pending = list(self._reaping)
        return not wait(pending, timeout).not_done

    def close(self) -> None:
        """Waits for the calls already running (each ends within its wall-clock limit); drops those not started;
        then waits for the background removal of their temp dirs."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._reaper.shutdown(wait=True)

    def _cleanup(self, workdir: str) -> None:
        if _remove(workdir, time.monotonic() + CLEANUP_S):
            return
        try:
            future = self._reaper.submit(self._finish_removal, workdir)
        except RuntimeError:  # closed meanwhile: finish here, unbounded, rather than leave it
            self._finish_removal(workdir)
            return
        with self._reaping_lock:
            self._reaping.add(future)
        future.add_done_callback(self._reaped)

    def _reaped(self, future: Future[None]) -> None:
        with self._reaping_lock:
            self._reaping.discard(future)

    @staticmethod
    def _finish_removal(workdir: str) -> None:
        if not _remove(workdir):
            logger.warning("tool sandbox: could not remove the temp dir %s", workdir)

    def __enter__(self) -> PythonSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def layers() -> dict[str, bool | int]:
        """The kernel layers available here (probed in this process; a call's child probes again itself)."""
        abi = runner.landlock_abi()
        return {"landlock": abi >= 1, "landlock_abi": abi, "landlock_net": abi >= 4, "landlock_scope": abi >= 6,
                "seccomp": runner.seccomp_available(), "drop_uid": os.geteuid() == 0}

    def _execute(self, code: str, workdir: str) -> _Run:
        lim = self.limits
        drop = NOBODY if os.geteuid() == 0 else None
        if drop is not None:
            os.chown(workdir, drop, drop)
        status_r, status_w = os.pipe()
        job = json.dumps({"code": code, "limits": asdict(lim), "status_fd": status_w, "workdir": workdir,
                          "drop_uid": drop, "kernel_layers": self.kernel_layers,
                          "require_kernel_layers": self.require_kernel_layers}).encode()
        # The child starts as us and drops to `drop` itself, after its imports: a uid-65534 exec of an interpreter
        # under a 0700 directory (pyenv in /root) would fail. No environment of ours (keys, tokens) goes along.
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir}
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", RUNNER], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir, env=env,
                                    start_new_session=True, close_fds=True, pass_fds=(status_w,))
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)  # the child's copy is the only writer left: EOF once it is gone
        try:
            if self.on_spawn is not None:
                self.on_spawn(proc.pid)
            out, err, killed = _pump(proc, job, time.monotonic() + lim.wall_s, lim.output_bytes)
        finally:
            status, cpu = _kill_and_reap(proc)
            os.set_blocking(status_r, False)
            try:
                started = os.read(status_r, 1) == runner.STARTED
            except BlockingIOError:
                started = False
            os.close(status_r)
        return _Run(out, err, killed, status, cpu, started)


def _pump(proc: subprocess.Popen, job: bytes, deadline: float, cap: int) -> tuple[bytes, bytes, str | None]:
    """Feeds the job to the child and reads its output until it exits, prints past `cap` bytes, or the deadline
    passes. A selector loop, not `communicate`: a child printing forever must not make us buffer it all."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    sel = selectors.DefaultSelector()
    try:  # readable once the child exits, without reaping it (so that its pgid stays ours to kill)
        pidfd: int | None = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # a kernel before 5.3: poll for the exit instead
        pidfd = None
    fin, fout, ferr = proc.stdin.fileno(), proc.stdout.fileno(), proc.stderr.fileno()
    try:
        os.set_blocking(fin, False)
        sel.register(fin, selectors.EVENT_WRITE, "in")
        sel.register(fout, selectors.EVENT_READ, "out")
        sel.register(ferr, selectors.EVENT_READ, "err")
        if pidfd is not None:
            sel.register(pidfd, selectors.EVENT_READ, "exit")
        chunks: dict[str, list[bytes]] = {"out": [], "err": []}
        sent = total = 0
        pipes, exited = 2, False
        while pipes or not exited:
            left = deadline - time.monotonic()
            if left <= 0:
                return b"".join(chunks["out"]), b"".join(chunks["err"]), "timeout"
            if pidfd is None and not exited:
                exited = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
                left = min(left, 0.02)
            for key, _ in sel.select(left):
                if key.data == "exit":
                    exited = True
                    sel.unregister(pidfd)
                elif key.data == "in":
                    try:
                        sent += os.write(fin, job[sent:sent + READ_CHUNK])
                    except BlockingIOError:
                        pass
                    except BrokenPipeError:  # gone before reading it all: its exit status says why
                        sent = len(job)
                    if sent >= len(job):
                        sel.unregister(fin)
                        proc.stdin.close()
                else:
                    data = os.read(key.fd, READ_CHUNK)
                    if not data:
                        sel.unregister(key.fd)
                        pipes -= 1
                        continue
                    chunks[key.data].append(data)
                    total += len(data)
                    if total > cap:
                        return b"".join(chunks["out"]), b"".join(chunks["err"]), "output_limit"
        return b"".join(chunks["out"]), b"".join(chunks["err"]), None
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)


def _kill_and_reap(proc: subprocess.Popen) -> tuple[int, float]:
    """SIGKILLs the child's whole process group (the child is its leader: start_new_session) and reaps the child.
    Not yet reaped, even an exited child still holds its pgid, so the group kill cannot hit a reused one. Returns
    the child's wait status (as Popen.returncode) and the CPU seconds it used."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for f in (proc.stdin, proc.stdout, proc.stderr):
        try:
            if f is not None:
                f.close()
        except OSError:  # stdin's flush into a dead child's pipe: nothing left to say to it
            pass
    try:
        _, wstatus, usage = os.wait4(proc.pid, 0)
    except ChildProcessError:  # reaped by someone else (a SIGCHLD handler of the host process): status unknown
        proc.returncode = -signal.SIGKILL
        return proc.returncode, 0.0
    proc.returncode = os.waitstatus_to_exitcode(wstatus)
    return proc.returncode, usage.ru_utime + usage.ru_stime


def _interpret(r: _Run, lim: SandboxLimits) -> tuple[bool, str, str | None]:
    """(ok, text for the model, error kind) from what the child did."""
    out = r.out.decode("utf-8", "replace")
    err = r.err.decode("utf-8", "replace")
    both = out + err
    if r.killed == "output_limit":
        head = both[:OUTPUT_HEAD] + ("..." if len(both) > OUTPUT_HEAD else "")
        return False, f"{head}\nError (output_limit): the code printed more than {lim.output_bytes} bytes", \
            "output_limit"
    if r.killed == "timeout":
        return False, f"{both}Error (timeout): the code ran past {lim.wall_s:g}s", "timeout"
    if r.status == -signal.SIGXCPU or (r.status == -signal.SIGKILL and r.cpu_s >= lim.cpu_s - 0.05):
        return False, f"{both}Error (cpu_limit): the code used more than {lim.cpu_s}s of CPU time", "cpu_limit"
    if not r.started:  # it died before the code ran: the sandbox's failure, never the code's
        detail = err.strip()[-500:] or _status_text(r.status)
        return False, f"Error (sandbox): {detail}", "sandbox"
    if r.status == runner.EXIT_OK:
        return True, both, None
    kinds = {runner.EXIT_EXCEPTION: "exception", runner.EXIT_FORBIDDEN: "forbidden", runner.EXIT_MEMORY: "memory"}
    if r.status in kinds:
        return False, both, kinds[r.status]
    # The code ended the interpreter itself (os._exit, a crash in native code): its own doing, not the sandbox's.
    return False, f"{both}Error (exception): {_status_text(r.status)}", "exception"


def _status_text(status: int) -> str:
    if status < 0:
        return f"the process died of {SIGNAL_NAMES.get(-status, f'signal {-status}')}"
    return f"the process exited with status {status}"


def _remove(path: str, deadline: float | None = None) -> bool:
    """Removes a call's temp dir, whatever the code left in it; returns whether it is gone. Never raises, and stops
    at `deadline` (time.monotonic) with the tree still whole, for a later call to finish.

    Iterative and flat: each subdirectory is first moved up to the top (a rename, O(1)), so no path grows deeper
    than two names and no fd is held for a level (a 1,500-deep tree is deeper than the recursion limit and longer
    than PATH_MAX). Each directory is made ours to enter and move before we do (a parent that is not root could
    not go into one the code made mode 000). The child is dead by now: nothing changes the tree under us."""
    tag = f".asyncrl-rm-{os.urandom(8).hex()}-"  # the code cannot have made a name with this tag
    try:
        os.chmod(path, stat.S_IRWXU)
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return not os.path.lexists(path)
    moved = 0
    try:
        pending = [e.name for e in _entries(top) if _is_dir(e)] + [None]  # None: the files at the top
        while pending:
            if deadline is not None and time.monotonic() > deadline:
                return False
            name = pending.pop()
            fd = top if name is None else _open_dir(name, top)
            if fd is None:
                continue
            try:
                for e in _entries(fd):
                    if deadline is not None and time.monotonic() > deadline:
                        return False
                    try:
                        if not _is_dir(e):
                            os.unlink(e.name, dir_fd=fd)
                        elif fd != top:
                            new = f"{tag}{moved}"
                            moved += 1
                            os.chmod(e.name, stat.S_IRWXU, dir_fd=fd)  # a move to a new parent writes its '..'
                            os.rename(e.name, new, src_dir_fd=fd, dst_dir_fd=top)
                            pending.append(new)
                    except OSError:
                        pass
            finally:
                if fd != top:
                    os.close(fd)
            if name is not None:
                try:
                    os.rmdir(name, dir_fd=top)
                except OSError:
                    pass
    except Exception:  # cleanup never raises: what is left is reported (and logged)
        logger.exception("tool sandbox: removing %s failed", path)
        return False
    finally:
        os.close(top)
    try:
        os.rmdir(path)
    except OSError:
        pass
    return not os.path.lexists(path)


def _entries(fd: int) -> list[os.DirEntry]:
    try:
        with os.scandir(fd) as it:
            return list(it)
    except OSError:
        return []


def _is_dir(e: os.DirEntry) -> bool:
    try:
        return e.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _open_dir(name: str, top: int) -> int | None:
    try:
        os.chmod(name, stat.S_IRWXU, dir_fd=top, follow_symlinks=True)  # a directory, checked by the caller
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
    except OSError:
        return None
