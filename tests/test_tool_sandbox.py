"""The tool sandbox (`asyncrl/tools/sandbox.py`): hostile code fails with the right error kind, within its limits,
leaves no process behind, and the sandbox keeps working; good code gets its output; calls overlap."""

import os
import socket
import subprocess
import tempfile
import threading
import time

import pytest

from asyncrl.tools.sandbox import RUNNER, PythonSandbox, SandboxLimits

LIMITS = SandboxLimits(wall_s=2.0, cpu_s=1)  # short limits: the runaway cases end in about a second or two
LAYERS = PythonSandbox.layers()
kernel = pytest.mark.skipif(not (LAYERS["landlock"] and LAYERS["seccomp"]),
                            reason=f"kernel layers missing here: {LAYERS}")


class Spawned(list):
    """The pids of the children a sandbox started (its `on_spawn` hook)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

        self.workdirs: dict[int, str] = {}

    def __call__(self, pid: int) -> None:
        try:  # the child starts in its call's temp dir; the job (and the code) reaches it only after this hook
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            cwd = None
        with self._lock:
            self.append(pid)
            if cwd is not None:
                self.workdirs[pid] = cwd


@pytest.fixture(scope="module")
def box():
    spawned = Spawned()
    sb = PythonSandbox(LIMITS, workers=4, on_spawn=spawned)
    sb.spawned = spawned
    yield sb
    sb.close()


def _stat_fields(pid: str) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp session ...


def _runner_processes(ours: set[int]) -> list[str]:
    """Live processes running sandbox_runner.py that are ours: our children, or in the session of one (a process
    the code forked). Other work on this machine may run sandboxes of its own; those are not ours to count."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if RUNNER.encode() not in f.read():
                    continue
            fields = _stat_fields(pid)
        except OSError:  # gone meanwhile
            continue
        if int(pid) in ours or int(fields[1]) == os.getpid() or int(fields[3]) in ours:
            found.append(f"{pid} {fields[0]}")
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def contained(sb: PythonSandbox, code: str, kinds: tuple[str, ...]):
    """Runs hostile code: it fails with one of `kinds` within the limit, its processes are gone, and the sandbox
    still works."""
    before = len(sb.spawned)
    r = sb.run(code)
    assert not r.ok and r.error in kinds, r
    assert r.latency_s < sb.limits.wall_s + 2, r
    mine = sb.spawned[before:]
    assert len(mine) == 1 and not any(_alive(p) for p in mine), mine
    assert _runner_processes(set(sb.spawned)) == []
    after = sb.run("print(6*7)")
    assert after.ok and after.output.strip() == "42", after
    return r


@kernel
def test_fork_bomb_and_subprocess_are_refused(box):
    r = contained(box, "import os\nwhile True: os.fork()", ("forbidden",))
    assert "PermissionError" in r.output and "os.fork()" in r.output
    contained(box, "import subprocess\nsubprocess.run(['sh', '-c', 'echo hi'])", ("forbidden",))


def test_runaway_cpu_and_sleep_are_stopped(box):
    r = contained(box, "while True: pass", ("cpu_limit", "timeout"))
    assert r.output.startswith("Error (")
    r = contained(box, "import time; time.sleep(100)", ("timeout",))
    assert r.latency_s >= LIMITS.wall_s and "Error (timeout): the code ran past 2s" in r.output


def test_a_huge_allocation_is_a_memory_error(box):
    r = contained(box, "x = bytearray(10 * 1024**3)", ("memory",))
    assert "MemoryError" in r.output


@kernel
def test_no_network(box):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        r = contained(box, f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)",
                      ("forbidden",))
        assert "PermissionError" in r.output
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing ever connected
            listener.accept()


@kernel
def test_no_writes_outside_the_temp_dir(box, tmp_path):
    target = tmp_path / "escaped.txt"
    contained(box, f"open({str(target)!r}, 'w').write('x')", ("forbidden",))
    assert not target.exists()
    # A world-writable dir: file modes would let uid 65534 in, so what stops the write is Landlock.
    open_dir = tempfile.mkdtemp(prefix="sandbox-test-")
    try:
        os.chmod(open_dir, 0o777)
        target = os.path.join(open_dir, "escaped.txt")
        contained(box, f"open({target!r}, 'w').write('x')", ("forbidden",))
        assert not os.path.exists(target)
    finally:
        os.rmdir(open_dir)


@kernel
def test_no_reads_outside_the_temp_dir(box, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2-secret-token")
    r = contained(box, f"print(open({str(secret)!r}).read())", ("forbidden",))
    assert "hunter2" not in r.output
    r = contained(box, "print(open('/etc/passwd').read())", ("forbidden",))  # world-readable: Landlock stops it
    assert "root:" not in r.output and "Permission denied" in r.output


def test_output_past_the_cap_is_an_error_not_a_flood(box):
    r = contained(box, 'print("x" * 10_000_000)', ("output_limit",))
    assert len(r.output) <= LIMITS.output_bytes and "Error (output_limit)" in r.output


@kernel
def test_cannot_kill_a_process_outside(box):
    victim = subprocess.Popen(["sleep", "60"])
    try:
        r = contained(box, f"import os, signal; os.kill({victim.pid}, signal.SIGKILL)", ("forbidden",))
        assert "Operation not permitted" in r.output
        time.sleep(0.1)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


@kernel
def test_cannot_reach_a_sibling_call_of_the_same_uid(box):
    """Concurrent calls share a uid, so file modes do not keep them apart: the kernel layers must. prlimit and
    sched_setaffinity on another process are the seccomp filter's alone to refuse (Landlock does not cover them)."""
    before = len(box.spawned)
    sibling = box.submit("import time; time.sleep(1.2); print('alive')")
    while len(box.spawned) == before:
        time.sleep(0.01)
    pid = box.spawned[before]
    time.sleep(0.3)  # past its setup: it runs as the same uid as the calls below
    for code in [f"import os; os.kill({pid}, 9)", f"import os; os.sched_setaffinity({pid}, {{0}})",
                 f"import resource; resource.prlimit({pid}, resource.RLIMIT_NOFILE, (1, 1))"]:
        r = box.run(code)
        assert r.error == "forbidden" and "Operation not permitted" in r.output, (code, r)
    assert sibling.result().output == "alive\n"
    r = box.run("import os, resource; os.kill(os.getpid(), 0); resource.getrlimit(resource.RLIMIT_NOFILE)")
    assert r.ok and r.output == f"({LIMITS.open_files}, {LIMITS.open_files})\n", r  # its own process: allowed


def test_good_code_gets_its_output(box, monkeypatch):
    cases = [("print(6 * 7)", "42\n"), ("2 ** 100", f"{2 ** 100}\n"), ("x = 3\nx * 5", "15\n"),
             ("import math\nmath.factorial(20)", f"{__import__('math').factorial(20)}\n"),
             ("import json; print(json.dumps({'a': [1, 2]}))", '{"a": [1, 2]}\n'),
             ("None", ""), ("x = 1", ""),
             ("with open('f.txt', 'w') as f:\n    f.write('inside')\nprint(open('f.txt').read())", "inside\n"),
             ("from fractions import Fraction\nFraction(1, 3) + Fraction(1, 6)", "Fraction(1, 2)\n"),
             ("import base64, email.mime.text\nbase64.b64encode(b'ok')", "b'b2s='\n")]
    for code, want in cases:
        r = box.run(code)
        assert r.ok and r.error is None and r.output == want, (code, r)
    monkeypatch.setenv("ASYNCRL_SANDBOX_TEST_SECRET", "leak")  # our environment does not reach the code
    assert box.run("import os; os.environ.get('ASYNCRL_SANDBOX_TEST_SECRET')").output == ""
    if LAYERS["drop_uid"]:
        assert box.run("import os; os.getuid(), os.getgid(), os.getgroups()").output == "(65534, 65534, [])\n"


def test_syntax_error_is_an_exception_naming_it(box):
    r = box.run("x = (1,\nprint(x")
    assert not r.ok and r.error == "exception" and "SyntaxError" in r.output, r
    r = box.run("def f():\n    return 1 / 0\nf()")
    assert r.error == "exception" and "ZeroDivisionError" in r.output and "return 1 / 0" in r.output, r
    assert len(r.output.splitlines()) <= 8  # a short traceback: the code's own frames only


def test_calls_run_concurrently():
    with PythonSandbox(SandboxLimits(wall_s=5.0), workers=4) as sb:
        futures = [sb.submit(f"print({i} * {i})") for i in range(8)]
        assert [f.result().output for f in futures] == [f"{i * i}\n" for i in range(8)]
        t0 = time.monotonic()
        futures = [sb.submit("import time; time.sleep(1); print('done')") for _ in range(4)]
        assert all(f.result().ok for f in futures)
        assert time.monotonic() - t0 < 2.5  # they overlap: one at a time would take 4 s


def test_the_audit_hook_fallback_stops_honest_mistakes(tmp_path):
    """Without the kernel layers (forced off here): weaker, but a model's plain attempts still fail."""
    with PythonSandbox(LIMITS, workers=1, require_kernel_layers=False, kernel_layers=False) as sb:
        assert sb.run("import math; math.sqrt(16)").output == "4.0\n"
        assert sb.run("open('f', 'w').write('ab')").output == "2\n"
        for code in ["open('/etc/passwd').read()", f"open({str(tmp_path / 'x')!r}, 'w')",
                     "import socket; socket.socket()", "import os; os.fork()",
                     "import subprocess; subprocess.run(['true'])"]:
            r = sb.run(code)
            assert r.error == "forbidden", (code, r)
        assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError):
        PythonSandbox(kernel_layers=False)


def test_layers_are_reported():
    assert set(LAYERS) >= {"landlock", "landlock_abi", "seccomp"}
    assert LAYERS["landlock"] == (LAYERS["landlock_abi"] >= 1)


def _workdir_of_last_call(sb: PythonSandbox) -> str:
    return sb.spawned.workdirs[sb.spawned[-1]]


def test_a_deep_tree_is_removed_without_raising():
    """1,500 nested directories: deeper than Python's recursion limit and than PATH_MAX as one path. (Landlock
    checks each access up the whole path: making them takes seconds, hence the longer limits.)"""
    spawned = Spawned()
    with PythonSandbox(SandboxLimits(wall_s=20.0, cpu_s=15), workers=1, on_spawn=spawned) as sb:
        sb.spawned = spawned
        r = sb.run("import os\nfor _ in range(1500):\n    os.mkdir('d')\n    os.chdir('d')\nprint(len(os.getcwd()))")
        assert r.ok and int(r.output) > 3000, r
        assert sb.wait_for_cleanup(30)
        assert not os.path.exists(_workdir_of_last_call(sb))


def test_many_files_are_cleaned_up_within_a_bound():
    """Code that makes directories until the wall limit: removing them takes longer than making them. The call
    returns within its limit and a bounded cleanup; what is left is removed in the background."""
    spawned = Spawned()
    with PythonSandbox(SandboxLimits(wall_s=3.0, cpu_s=5), workers=1, on_spawn=spawned) as sb:
        sb.spawned = spawned
        r = sb.run("import os\ni = 0\nwhile True:\n    os.mkdir(str(i))\n    i += 1")
        assert r.error == "timeout", r
        assert r.latency_s < sb.limits.wall_s + 1.0, r
        assert sb.wait_for_cleanup(60)
        assert not os.path.exists(_workdir_of_last_call(sb))
        assert sb.run("print(6*7)").output == "42\n"


@pytest.fixture
def outside_file():
    """A file outside the call's temp dir that the call's uid owns, in a directory anyone may enter: file modes
    would let the call change its metadata, so only the sandbox can stop it."""
    folder = tempfile.mkdtemp(prefix="sandbox-test-")
    os.chmod(folder, 0o755)
    path = os.path.join(folder, "victim.txt")
    with open(path, "w") as f:
        f.write("x")
    os.chmod(path, 0o644)
    if LAYERS["drop_uid"]:
        os.chown(path, 65534, 65534)
    try:
        yield path
    finally:
        os.remove(path)
        os.rmdir(folder)


@kernel
def test_no_metadata_changes_outside_the_temp_dir(box, outside_file):
    """Landlock has no right for a file's times, mode, owner or extended attributes: the seccomp filter refuses
    those calls (inside the temp dir too: a calculation does not need them)."""
    before = os.stat(outside_file)
    for code in [f"import os; os.utime({outside_file!r}, (0, 0))", f"import os; os.utime({outside_file!r})",
                 f"import os; os.chmod({outside_file!r}, 0o777)",
                 f"import os; os.setxattr({outside_file!r}, 'user.x', b'1')"]:
        r = contained(box, code, ("forbidden",))
        assert "Operation not permitted" in r.output, (code, r)
    after = os.stat(outside_file)
    assert (after.st_mtime_ns, after.st_atime_ns, after.st_mode) == \
        (before.st_mtime_ns, before.st_atime_ns, before.st_mode)
    assert os.listxattr(outside_file) == []


@kernel
def test_no_memory_outside_the_cap_through_memfd():
    """Pages of a memfd (or any shared-memory file) are not address space: RLIMIT_AS would let the code hold
    20 x 16 MB beside a 128 MB cap. memfd_create is refused; /dev/shm is outside Landlock's rules."""
    spawned = Spawned()
    with PythonSandbox(SandboxLimits(wall_s=10.0, cpu_s=8, memory_mb=128), workers=1, on_spawn=spawned) as sb:
        sb.spawned = spawned
        code = ("import os\nfds, block = [], bytes(16 << 20)\nfor _ in range(20):\n    fd = os.memfd_create('x')\n"
                "    os.write(fd, block)\n    fds.append(fd)\nprint(len(fds))")
        r = contained(sb, code, ("forbidden",))
        assert "Operation not permitted" in r.output
        contained(sb, "open('/dev/shm/x', 'wb').write(bytes(1 << 20))", ("forbidden",))
        assert not os.path.exists("/dev/shm/x")


def test_remove_is_resumable_keeps_links_and_never_raises(tmp_path):
    """The cleanup alone: stopped at its deadline it leaves a whole tree that a later call finishes; it deletes a
    symlink, never what it points to; mode-000 directories and a 1,500-deep chain go too."""
    from asyncrl.tools.sandbox import _remove

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    root = tmp_path / "call"
    deep = os.open(str(tmp_path), os.O_RDONLY)
    os.mkdir("call", dir_fd=deep)
    for depth in range(1501):  # by fd: the path outgrows PATH_MAX
        nxt = os.open("call" if depth == 0 else "d", os.O_RDONLY, dir_fd=deep)
        os.close(deep)
        deep = nxt
        os.mkdir("d", dir_fd=deep)
    os.close(deep)
    for i in range(50):
        (root / f"f{i}").write_text("x")
    (root / "link").symlink_to(outside)
    (root / "locked" / "inner").mkdir(parents=True)
    os.chmod(root / "locked" / "inner", 0)
    os.chmod(root / "locked", 0)
    assert _remove(str(root), deadline=time.monotonic()) is False and root.exists()
    assert _remove(str(root)) is True and not root.exists()
    assert (outside / "keep.txt").read_text() == "keep"
    assert _remove(str(tmp_path / "never-made")) is True
