"""The child side of `asyncrl/tools/sandbox.py`: one call of model-written Python, in a fresh interpreter.

Stdlib only: it runs as `python -I -S sandbox_runner.py` (no site-packages, so it cannot import asyncrl; the parent
imports it only for the constants and the layer probes below, and importing it runs nothing).

Protocol: the job is JSON on stdin; stdout and stderr are the code's own; one byte on `status_fd` says the code
started (so a death before it is a setup failure, error 'sandbox'); the exit status names the outcome (EXIT_*).

Order, before any of the code runs: rlimits, pre-imports, privilege drop, Landlock, seccomp. The kernel layers
are the boundary; the audit-hook layer used without them stops honest mistakes, not a hostile program.
"""

from __future__ import annotations

import ast
import ctypes
import errno
import functools
import json
import linecache
import os
import resource
import struct
import sys
import sysconfig
import traceback

EXIT_OK, EXIT_EXCEPTION, EXIT_FORBIDDEN, EXIT_MEMORY, EXIT_SANDBOX = 0, 10, 11, 12, 13
STARTED = b"R"

# Imported before the filesystem lock, so that their files (and shared libraries) are already mapped. binascii
# (base64, email) and zlib link the system's libz, which Landlock hides later; a module that links another system
# library (_ssl, _lzma, _bz2, _sqlite3) cannot be imported in a call, and hashlib falls back to its builtin hashes.
PREIMPORTS = ("math", "json", "re", "itertools", "functools", "collections", "fractions", "decimal", "statistics",
              "random", "string", "datetime", "operator", "heapq", "bisect", "binascii", "zlib")

# Landlock (include/uapi/linux/landlock.h). The syscall numbers are the same on x86_64 and aarch64.
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 2, 1 << 3
FS_ABI1 = (1 << 13) - 1  # EXECUTE .. MAKE_SYM
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
PR_SET_NO_NEW_PRIVS, PR_GET_SECCOMP, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 21, 22, 2

# seccomp-bpf: the filter sees struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}.
RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_JSET_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
CLONE_THREAD = 0x10000
X32_SYSCALL_BIT = 0x40000000
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}  # the architectures the filter knows
# name: (x86_64, aarch64) numbers; None where the architecture has no such call (glibc forks with clone there).
SYSCALLS = {
    "clone": (56, 220), "clone3": (435, 435), "fork": (57, None), "vfork": (58, None), "execve": (59, 221),
    "execveat": (322, 281), "socket": (41, 198), "socketpair": (53, 199), "ptrace": (101, 117),
    "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40), "bpf": (321, 280), "userfaultfd": (323, 282),
    "perf_event_open": (298, 241), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218), "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426), "io_uring_register": (427, 427), "pidfd_send_signal": (424, 424),
    "setpriority": (141, 140), "ioprio_set": (251, 30), "shmget": (29, 194), "shmat": (30, 196),
    "shmctl": (31, 195), "semget": (64, 190), "semop": (65, 193), "semctl": (66, 191), "semtimedop": (220, 192),
    "msgget": (68, 186), "msgsnd": (69, 189), "msgrcv": (70, 188), "msgctl": (71, 187),
    "kill": (62, 129), "tkill": (200, 130), "tgkill": (234, 131), "rt_sigqueueinfo": (129, 138),
    "rt_tgsigqueueinfo": (297, 240), "prlimit64": (302, 261), "sched_setaffinity": (203, 122),
    "sched_setscheduler": (144, 119), "sched_setparam": (142, 118), "sched_setattr": (314, 274),
    "utime": (132, None), "utimes": (235, None), "futimesat": (261, None), "utimensat": (280, 88),
    "chmod": (90, None), "fchmod": (91, 52), "fchmodat": (268, 53), "fchmodat2": (452, 452), "chown": (92, None),
    "fchown": (93, 55), "lchown": (94, None), "fchownat": (260, 54), "setxattr": (188, 5), "lsetxattr": (189, 6),
    "fsetxattr": (190, 7), "removexattr": (197, 14), "lremovexattr": (198, 15), "fremovexattr": (199, 16),
    "setxattrat": (463, 463), "removexattrat": (466, 466), "memfd_create": (319, 279),
    "memfd_secret": (447, 447), "mq_open": (240, 180),
}
# EPERM: new processes, programs and sockets; then what no calculation needs and that reaches past the process:
# kernel interfaces that widen the attack surface (io_uring can even open sockets without the socket syscall),
# and the other processes of our uid (SysV IPC, priorities), which Landlock does not cover. Then a file's
# metadata: Landlock has no right for times, mode, owner or xattrs, so a path outside the temp dir that the uid
# owns or may write would be changed (refused inside it too: a seccomp filter cannot read a path, and no
# calculation needs them; shutil.copy/copy2 fail, copyfile works). Then memory that is no address space, so
# RLIMIT_AS misses it: memfd pages and POSIX message queues (/dev/shm is outside Landlock's rules already).
DENIED = ("fork", "vfork", "execve", "execveat", "socket", "socketpair", "ptrace", "unshare", "setns", "mount",
          "bpf", "userfaultfd", "perf_event_open", "process_vm_readv", "process_vm_writev", "keyctl", "add_key",
          "request_key", "io_uring_setup", "io_uring_enter", "io_uring_register", "pidfd_send_signal",
          "setpriority", "ioprio_set", "shmget", "shmat", "shmctl", "semget", "semop", "semctl", "semtimedop",
          "msgget", "msgsnd", "msgrcv", "msgctl", "utime", "utimes", "futimesat", "utimensat", "chmod", "fchmod",
          "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat", "setxattr", "lsetxattr", "fsetxattr",
          "removexattr", "lremovexattr", "fremovexattr", "setxattrat", "removexattrat", "memfd_create",
          "memfd_secret", "mq_open")
# Allowed on this process only (args[0] is 0 or its pid): signals, rlimits and scheduling of another process of
# the same uid (the parent itself, where it is not root) need no Landlock ABI 6 to be refused.
SELF_ONLY = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "prlimit64", "sched_setaffinity",
             "sched_setscheduler", "sched_setparam", "sched_setattr")


class SandboxUnavailable(RuntimeError):
    """A layer the job requires cannot be set up here."""


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.prctl.restype = ctypes.c_int
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return libc


def _syscall(libc: ctypes.CDLL, nr: int, *args: int) -> int:
    # Every argument as a long: syscall() is variadic, and a C int there leaves the register's upper half undefined.
    ret = libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) for a in args))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where there is none (or it is disabled)."""
    try:
        return _syscall(_libc(), SYS_LANDLOCK_CREATE_RULESET, 0, 0, LANDLOCK_CREATE_RULESET_VERSION)
    except OSError:
        return 0


def seccomp_available() -> bool:
    """Whether a seccomp filter can be installed here: a kernel with filters, on an architecture the filter knows."""
    return (os.uname().machine in AUDIT_ARCH and _libc().prctl(PR_GET_SECCOMP, 0, 0, 0, 0) >= 0
            and os.path.exists("/proc/sys/kernel/seccomp/actions_avail"))


def apply_landlock(abi: int, read_only: list[str], read_write: list[str]) -> None:
    """No file access outside `read_only` (read, list, execute) and `read_write` (everything); no TCP bind or
    connect (ABI >= 4); no signals or abstract unix sockets to anything outside this process (ABI >= 6)."""
    libc = _libc()
    fs = FS_ABI1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0) | \
        (FS_IOCTL_DEV if abi >= 5 else 0)
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    # An older kernel rejects fields it does not know: pass only the struct prefix its ABI defines.
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    attr = ctypes.create_string_buffer(struct.pack("=QQQ", fs, net, scoped), 24)
    ruleset = _syscall(libc, SYS_LANDLOCK_CREATE_RULESET, ctypes.addressof(attr), size, 0)
    try:
        rules = [(d, FS_READ_FILE | FS_READ_DIR | FS_EXECUTE) for d in read_only] + [(d, fs) for d in read_write]
        for path, access in rules:
            dfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:  # struct landlock_path_beneath_attr is packed: u64 allowed_access, s32 parent_fd
                rule = ctypes.create_string_buffer(struct.pack("=Qi", access, dfd), 12)
                _syscall(libc, SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.addressof(rule), 0)
            finally:
                os.close(dfd)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        _syscall(libc, SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0)
    finally:
        os.close(ruleset)


def seccomp_program(machine: str, pid: int) -> list[tuple[int, int, int, int]]:
    """The BPF filter as (code, jt, jf, k): another architecture is killed (its syscall numbers differ), x32 calls
    too; DENIED calls fail with EPERM, SELF_ONLY ones unless aimed at `pid` (this process) or 0; clone only makes
    threads (CLONE_THREAD set); clone3 says ENOSYS, so that glibc falls back to clone, whose flags the filter can
    read (clone3's are behind a pointer). Arguments are compared by their low 32 bits (little-endian), which is
    all of a pid_t or a clone flag that matters here."""
    col = 0 if machine == "x86_64" else 1
    nr = {name: nums[col] for name, nums in SYSCALLS.items() if nums[col] is not None}
    eperm, allow = (BPF_RET_K, 0, 0, RET_ERRNO | errno.EPERM), (BPF_RET_K, 0, 0, RET_ALLOW)
    arg0 = (BPF_LD_W_ABS, 0, 0, 16)
    prog = [(BPF_LD_W_ABS, 0, 0, 4), (BPF_JEQ_K, 1, 0, AUDIT_ARCH[machine]), (BPF_RET_K, 0, 0, RET_KILL_PROCESS),
            (BPF_LD_W_ABS, 0, 0, 0)]
    if machine == "x86_64":
        prog += [(BPF_JGE_K, 0, 1, X32_SYSCALL_BIT), (BPF_RET_K, 0, 0, RET_KILL_PROCESS)]
    for name in DENIED:
        if name in nr:
            prog += [(BPF_JEQ_K, 0, 1, nr[name]), eperm]
    prog += [(BPF_JEQ_K, 0, 1, nr["clone3"]), (BPF_RET_K, 0, 0, RET_ERRNO | errno.ENOSYS)]
    # Each block below loads args[0], so it ends in a return: the accumulator no longer holds the number.
    for name in SELF_ONLY:
        prog += [(BPF_JEQ_K, 0, 5, nr[name]), arg0, (BPF_JEQ_K, 2, 0, 0), (BPF_JEQ_K, 1, 0, pid), eperm, allow]
    prog += [(BPF_JEQ_K, 0, 4, nr["clone"]), arg0, (BPF_JSET_K, 0, 1, CLONE_THREAD), allow, eperm]
    return prog + [allow]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def apply_seccomp() -> None:
    machine = os.uname().machine
    if machine not in AUDIT_ARCH:
        raise SandboxUnavailable(f"seccomp: no filter for architecture {machine}")
    prog = seccomp_program(machine, os.getpid())
    buf = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *ins) for ins in prog))
    fprog = _SockFprog(len(prog), ctypes.addressof(buf))
    libc = _libc()
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_SECCOMP): {os.strerror(err)}")


def set_rlimits(limits: dict, final_uid: int) -> None:
    def cap(res: int, soft: int, hard: int | None = None) -> None:
        resource.setrlimit(res, (soft, soft if hard is None else hard))

    cap(resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1)  # soft: SIGXCPU; one second later: SIGKILL
    with open("/proc/self/status") as f:  # the interpreter's own size, so the cap is headroom for the code
        vm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    cap(resource.RLIMIT_AS, vm_kb * 1024 + limits["memory_mb"] * (1 << 20))
    cap(resource.RLIMIT_FSIZE, limits["file_bytes"])
    cap(resource.RLIMIT_NOFILE, limits["open_files"])
    cap(resource.RLIMIT_CORE, 0)
    if final_uid != 0:  # root ignores NPROC. Any n > 0 would race the other calls' processes (the count is per
        cap(resource.RLIMIT_NPROC, 0)  # uid, machine-wide), so no new task at all: not even a thread.


def stdlib_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    dirs = {paths["stdlib"], paths["platstdlib"]} | {p for p in sys.path if p.endswith("lib-dynload")}
    return sorted(os.path.realpath(d) for d in dirs if os.path.isdir(d))


def reroute_imports(dirs: list[str]) -> list[str]:
    """Keep the stdlib importable after the drop to an unprivileged uid, even where the interpreter lives under a
    directory that uid cannot enter (a pyenv under /root, mode 0700): an fd opened on each dir now, named through
    /proc/self/fd (the kernel lets a process through its own fd links, whatever the path above them). Returns
    those names, for the Landlock rules that are made after the drop."""
    tops = [d for d in dirs if not any(d.startswith(o + os.sep) for o in dirs)]  # lib-dynload: inside stdlib
    alias = {d: f"/proc/self/fd/{os.open(d, os.O_PATH | os.O_DIRECTORY)}" for d in tops}

    def moved(p: str) -> str:
        real = os.path.realpath(p)
        for d, a in alias.items():
            if real == d or real.startswith(d + os.sep):
                return a + real[len(d):]
        return p

    sys.path[:] = [moved(p) for p in sys.path]
    for mod in list(sys.modules.values()):  # a loaded package finds its submodules through __path__
        if isinstance(getattr(mod, "__path__", None), list):
            mod.__path__[:] = [moved(p) for p in mod.__path__]
    sys.path_importer_cache.clear()
    return list(alias.values())


def drop_privileges(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # from root to another uid: the kernel clears every capability
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (uid, uid, uid):
        raise SandboxUnavailable(f"could not become uid {uid}")


def audit_layer(read_dirs: list[str], workdir: str) -> None:
    """The fallback without the kernel layers: refuse the audit events of processes, sockets, signals, native code
    and file access outside the temp dir (reads: also the stdlib). Python code can get around it (it is no
    security boundary), but a model's honest mistake (reading /etc, fetching a URL) fails as it would in the
    kernel sandbox."""
    blocked = ("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
               "os.system", "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.", "_posixsubprocess.")
    path_events = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink",
                   "os.link", "os.truncate", "os.utime", "os.listdir", "os.scandir", "shutil.rmtree", "os.mkfifo"}
    readable = [workdir] + read_dirs

    def inside(path: object, dirs: list[str]) -> bool:
        if isinstance(path, int):
            return True  # an fd the process already holds
        real = os.path.realpath(os.fsdecode(path))  # type: ignore[arg-type]
        return any(real == d or real.startswith(d + os.sep) for d in dirs)

    def hook(event: str, args: tuple) -> None:
        if event.startswith(blocked):
            raise PermissionError(errno.EPERM, f"Operation not permitted (sandbox: {event})")
        if event == "open" and args[0] is not None:
            writes = args[2] & (os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC)
            if not inside(args[0], [workdir] if writes else readable):
                raise PermissionError(errno.EACCES, f"Permission denied: {args[0]!r}")
        elif event in path_events and args and not inside(args[0] if args[0] is not None else ".",
                                                          readable if event in ("os.listdir", "os.scandir")
                                                          else [workdir]):
            raise PermissionError(errno.EACCES, f"Permission denied: {args[0]!r}")

    sys.addaudithook(hook)


def setup(job: dict) -> None:
    drop = job.get("drop_uid")
    set_rlimits(job["limits"], os.geteuid() if drop is None else drop)
    for name in PREIMPORTS:
        __import__(name)
    workdir = os.path.realpath(job["workdir"])
    stdlib = rules = stdlib_dirs()
    if drop is not None:
        rules = reroute_imports(stdlib)
        drop_privileges(drop)
    missing = []
    abi = landlock_abi() if job["kernel_layers"] else 0
    seccomp = job["kernel_layers"] and seccomp_available()  # probed before Landlock hides /proc
    if abi >= 1:
        apply_landlock(abi, rules, [workdir])
    else:
        missing.append("landlock")
    if seccomp:
        apply_seccomp()
    else:
        missing.append("seccomp")
    if missing and job["require_kernel_layers"]:
        raise SandboxUnavailable(f"kernel layer(s) {', '.join(missing)} unavailable here "
                                 "(require_kernel_layers: the call was not run)")
    if missing:
        audit_layer(stdlib, workdir)


def short_traceback(e: BaseException, frames: int = 3) -> str:
    """The exception and the last few frames of the code itself: what the model needs to fix it, in few tokens."""
    tb = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == "<tool>"][-frames:]
    lines = (["Traceback (most recent call last):\n"] + traceback.format_list(tb)) if tb else []
    return "".join(lines + traceback.format_exception_only(type(e), e))[-2000:]


def run_code(code: str, limits: dict) -> int:
    """exec the code as a REPL cell would: a last statement that is an expression has its repr printed."""
    linecache.cache["<tool>"] = (len(code), None, code.splitlines(True), "<tool>")  # source lines in tracebacks
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        tree = ast.parse(code, "<tool>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<tool>", "exec"), scope)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), scope)
            if value is not None:
                print(repr(value))
        sys.stdout.flush()
        return EXIT_OK
    except SystemExit as e:
        if e.code in (None, 0):
            return EXIT_OK
        print(f"SystemExit: {e.code}", file=sys.stderr)
        return EXIT_EXCEPTION
    except MemoryError as e:
        print(short_traceback(e).rstrip() + f"\nError (memory): the code needed more than {limits['memory_mb']} MB",
              file=sys.stderr)
        return EXIT_MEMORY
    except BaseException as e:  # noqa: B902 -- everything the code raises is the model's to read
        print(short_traceback(e), end="", file=sys.stderr)
        forbidden = isinstance(e, OSError) and e.errno in (errno.EPERM, errno.EACCES)
        return EXIT_FORBIDDEN if forbidden else EXIT_EXCEPTION


def main() -> None:
    try:
        job = json.loads(sys.stdin.buffer.read())
        setup(job)
    except BaseException as e:  # noqa: B902 -- any setup failure is the sandbox's, and the code must not run
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(EXIT_SANDBOX)
    os.write(job["status_fd"], STARTED)
    os.close(job["status_fd"])
    sys.stdin.close()
    sys.exit(run_code(job["code"], job["limits"]))


if __name__ == "__main__":
    main()
