"""Run untrusted Python in a fresh `python -I` process inside bubblewrap.

What the sandbox gives the program:
- its own network (loopback only), PID, IPC, UTS and cgroup namespaces;
- a read-only view of the system (/usr, /lib*, /bin) and of the interpreter's install prefix only
  (never a home directory or the app's data); a private, size-capped tmpfs /tmp as working directory;
- uid 65534 without capabilities, no-new-privs, a scrubbed environment, stdin closed;
- rlimits: address space, CPU seconds, processes, file size, open files, no core files.
The parent enforces a wall-clock deadline, kills the whole process group (the PID namespace dies with
bwrap), and keeps at most OUTPUT_CAP bytes of each stream while still draining the rest.

`memory_mb` bounds the whole run, every process of it together, not each process: RLIMIT_AS is per
process, so a program that forks would multiply it. The parent therefore also watches the run: every
MEMORY_POLL_S it sums the proportional resident memory (PSS, so pages shared between forked processes
count once) of all the run's processes, and past `memory_mb` it kills all of them and reports
"memory". (A cgroup v2 memory.max would do this in the kernel, but needs a writable, delegated cgroup
tree, which these machines do not have; the watcher holds everywhere.)

Two ways to reach uid 65534, because RLIMIT_NPROC is counted per (user namespace, host uid) and the
host's root is exempt from it:
- not root: bwrap maps 65534 in a new user namespace onto our uid (the usual, unprivileged mode);
- root: a user namespace made by bwrap would map 65534 onto host root, where RLIMIT_NPROC is never
  enforced. So bwrap runs privileged without one, keeps only CAP_SETUID/CAP_SETGID, and the bootstrap
  below becomes host uid 65534 and then unshares a user namespace of its own, so the process limit
  counts this sandbox only (not every other sandbox running as 65534 at the same time).

No silent fallback: if bwrap cannot run, `run_python` raises SandboxUnavailable. The only way around
it is the loudly named env opt-out LANEPLAY_UNSAFE_NO_SANDBOX=1 (trusted local use; rlimits and a
process-group kill only).
"""
from __future__ import annotations

import functools
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

UNSAFE_ENV = "LANEPLAY_UNSAFE_NO_SANDBOX"
SANDBOX_UID = 65534  # "nobody"
OUTPUT_CAP = 64 * 1024  # bytes kept per stream (head and tail halves)
TMPFS_BYTES = 64 * 1024 * 1024  # /tmp lives in host RAM, so it is capped too
MAX_PROCESSES = 16  # processes (threads count too) of one run, the whole run together
MEMORY_POLL_S = 0.01  # how often the parent sums the run's memory
MAX_FILE_BYTES = 16 * 1024 * 1024
MAX_OPEN_FILES = 64
MAX_CODE_BYTES = 8 * 1024 * 1024
MAX_TIMEOUT_S = 600.0
STATUSES = ("ok", "error", "timeout", "memory", "killed")
INSTALL_HINT = "install bubblewrap (e.g. `apt-get install bubblewrap`)"


class SandboxUnavailable(RuntimeError):
    """Raised instead of running generated code when the sandbox cannot be set up."""


@dataclass
class Result:
    status: str  # one of STATUSES
    stdout: str
    stderr: str
    exit_code: int | None  # the program's exit code; -N when a signal N ended it
    seconds: float  # wall time from spawn to exit (sandbox start-up included)
    truncated: bool = False  # some output was dropped (see OUTPUT_CAP)
    peak_memory_mb: float = 0.0  # the most the run's processes held together, as the watcher saw it


# The sandboxed process itself (`python -I -S -c _BOOTSTRAP`): reads the code from an inherited fd,
# drops to uid 65534 if it is root, applies the rlimits (clamped to the current hard limits), then runs
# the code as __main__. -S keeps the base interpreter's site-packages (and its slow .pth files) out:
# generated code sees the stdlib only, the same on every machine.
_BOOTSTRAP = r"""
import builtins, os, resource as r, sys, traceback
fd, drop, cpu, mem, nproc, fsize, nofile = map(int, sys.argv[1:8])
code = bytearray()
while chunk := os.read(fd, 1 << 20):
    code += chunk
os.close(fd)
with open("main.py", "wb") as f:
    f.write(code)
if drop and os.getuid() == 0:
    os.setgroups([])
    os.setresgid(%(uid)d, %(uid)d, %(uid)d)
    os.setresuid(%(uid)d, %(uid)d, %(uid)d)
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x10000000) == 0:  # CLONE_NEWUSER: RLIMIT_NPROC now counts this sandbox only
        # ...and made us owner of that namespace, with every capability in it: give them all up.
        header, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()  # v3, all zero
        if libc.capset(header, data) != 0:
            sys.exit("sandbox: capset failed")
def limit(res, soft, hard=None):
    hard = soft if hard is None else hard
    cur = r.getrlimit(res)[1]
    if cur != r.RLIM_INFINITY:
        soft, hard = min(soft, cur), min(hard, cur)
    r.setrlimit(res, (soft, hard))
limit(r.RLIMIT_CPU, cpu, cpu + 1)  # SIGXCPU first, SIGKILL a second later
limit(r.RLIMIT_AS, mem)
limit(r.RLIMIT_NPROC, nproc)
limit(r.RLIMIT_FSIZE, fsize)
limit(r.RLIMIT_NOFILE, nofile)
limit(r.RLIMIT_CORE, 0)
builtins.exit = builtins.quit = sys.exit  # what `site` would have provided
sys.argv = [os.path.abspath("main.py")]
program = compile(bytes(code), sys.argv[0], "exec")
del code, chunk, f
try:
    exec(program, {"__name__": "__main__", "__file__": sys.argv[0], "__builtins__": builtins})
except SystemExit:
    raise
except BaseException as e:  # print as Python would, without this bootstrap's frame
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
""" % {"uid": SANDBOX_UID}


def _interpreter() -> tuple[str, str]:
    """The base interpreter (not the venv: the sandbox needs only the stdlib) and its install prefix."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    if not exe.startswith(prefix + os.sep):  # unusual layouts: bind the executable's own install dir
        prefix = os.path.dirname(os.path.dirname(exe))
    return exe, prefix


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


@functools.lru_cache(maxsize=1)
def _bwrap_argv() -> tuple[str, ...]:
    """bwrap and its options, everything up to the command; raises SandboxUnavailable."""
    bwrap = shutil.which("bwrap")
    if not bwrap:
        raise SandboxUnavailable(f"bubblewrap (`bwrap`) is not installed; {INSTALL_HINT}.")
    exe, prefix = _interpreter()
    home = os.path.realpath(os.path.expanduser("~"))
    if prefix == "/" or _inside(home, prefix):
        raise SandboxUnavailable(f"the Python installation at {prefix} contains the home directory; refusing "
                                 "to expose it to generated code (use an interpreter installed in its own prefix)")
    helptext = subprocess.run([bwrap, "--help"], capture_output=True, text=True).stdout

    argv = [bwrap, "--die-with-parent", "--new-session", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8", "--setenv", "HOME", "/tmp"]
    if os.geteuid() == 0:
        argv += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                 "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-all", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        if "--disable-userns" in helptext:
            argv += ["--disable-userns"]

    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/lib", "/lib64", "/lib32"):  # merged-/usr systems have symlinks here
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    if not any(_inside(prefix, d) for d in ("/usr", "/bin", "/lib", "/lib64", "/lib32")):
        # Only the prefix itself (e.g. ~/.pyenv/versions/3.11.7); its parents are empty, traversable dirs.
        parents = []
        p = os.path.dirname(prefix)
        while p != "/":
            parents.append(p)
            p = os.path.dirname(p)
        for p in reversed(parents):
            argv += ["--perms", "0755", "--dir", p]
        argv += ["--ro-bind", prefix, prefix]
    argv += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777"]
    if "--size" in helptext:
        argv += ["--size", str(TMPFS_BYTES)]
    argv += ["--tmpfs", "/tmp", "--remount-ro", "/", "--chdir", "/tmp", "--", exe]
    return tuple(argv)


@functools.lru_cache(maxsize=1)
def sandbox_available() -> tuple[bool, str]:
    """Can generated code run sandboxed here? (ok, reason) — cached; `.cache_clear()` to re-probe."""
    try:
        r = _execute(list(_bwrap_argv()), "import os; print(os.getuid())", 20.0, 256, drop=True)
    except SandboxUnavailable as e:
        return False, str(e)
    except OSError as e:
        return False, f"bubblewrap could not be started ({e}); {INSTALL_HINT}"
    if r.status == "ok" and r.stdout.strip() == str(SANDBOX_UID):
        return True, "bubblewrap sandbox works"
    detail = (r.stderr.strip() or r.stdout.strip() or f"exit code {r.exit_code}")[-500:]
    return False, f"bubblewrap is installed but could not start the sandbox ({r.status}: {detail}); {INSTALL_HINT} " \
                  "and make sure user namespaces are enabled"


@functools.lru_cache(maxsize=1)
def _warn_unsafe() -> None:
    print(f"WARNING: {UNSAFE_ENV}=1: generated code runs WITHOUT the bubblewrap sandbox "
          "(network, files and processes of this user are reachable). Trusted local use only.", file=sys.stderr)


def run_python(code: str, timeout_s: float = 10.0, memory_mb: int = 512) -> Result:
    """Run `code` as a program in the sandbox and report how it ended (never raises for what the code does)."""
    if not isinstance(code, str):
        raise TypeError("code must be a str")
    if len(code.encode("utf-8", "surrogatepass")) > MAX_CODE_BYTES:
        raise ValueError(f"code is larger than {MAX_CODE_BYTES} bytes")
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout_s must be in (0, {MAX_TIMEOUT_S}]")
    if not 64 <= memory_mb <= 65536:
        raise ValueError("memory_mb must be in [64, 65536]")
    if not require_sandbox():
        with tempfile.TemporaryDirectory(prefix="laneplay-unsafe-") as cwd:
            return _execute([_interpreter()[0]], code, timeout_s, memory_mb, drop=False, cwd=cwd)
    return _execute(list(_bwrap_argv()), code, timeout_s, memory_mb, drop=True)


def require_sandbox() -> bool:
    """True if code will run sandboxed, False under the explicit unsafe opt-out; else SandboxUnavailable.

    Callers about to do expensive work (generating samples) call this first to fail early.
    """
    if os.environ.get(UNSAFE_ENV) == "1":
        _warn_unsafe()
        return False
    ok, reason = sandbox_available()
    if not ok:
        raise SandboxUnavailable(f"refusing to run generated code: {reason}")
    return True


class _Capped:
    """Keeps the first and the last `cap // 2` bytes of a stream and counts what falls in between."""

    def __init__(self, cap: int):
        self.half, self.head, self.tail, self.dropped = cap // 2, bytearray(), bytearray(), 0

    def add(self, data: bytes) -> None:
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        excess = len(self.tail) - self.half
        if excess > 0:
            del self.tail[:excess]
            self.dropped += excess

    def text(self) -> str:
        mid = f"\n[... {self.dropped} bytes dropped ...]\n".encode() if self.dropped else b""
        return (bytes(self.head) + mid + bytes(self.tail)).decode("utf-8", "replace")


def _children(pid: int) -> list[int]:
    """Direct children of a process (all its threads'), from /proc/<pid>/task/*/children."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            pass
    return out


def _session_members(session: int) -> list[int]:
    """Every process whose session is `session` (a full /proc scan)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rfind(b")") + 2:].split()[3]) == session:  # after "pid (comm) ": state ppid pgrp session
                out.append(int(name))
    return out


def _descendants(root: int, sandboxed: bool = True) -> list[int]:
    """`root` and every process below it: the run's processes. In the sandbox, the PID namespace keeps
    orphans below its init (a descendant of root); without it, the run's session is scanned as well."""
    todo = [root] + ([] if sandboxed else _session_members(root))
    seen: set[int] = set()
    out = []
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            out.append(pid)
            todo.extend(_children(pid))
    return out


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _memory_bytes(pid: int) -> int:
    """Proportional set size of one process (shared pages split between their users); RSS if no PSS."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _kill_all(root: int, sandboxed: bool) -> None:
    """SIGKILL the run: its process group, and every process below its root (whatever group it moved to)."""
    for _ in range(3):  # a process may fork while we kill: repeat until nothing is left
        pids = _descendants(root, sandboxed)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(root, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if len(pids) <= 1:
            break


def _execute(prefix_argv: list[str], code: str, timeout_s: float, memory_mb: int,
             drop: bool, cwd: str | None = None) -> Result:
    codefd = os.memfd_create("laneplay-code")  # close-on-exec; passed to the child explicitly
    try:
        os.write(codefd, code.encode("utf-8", "surrogatepass"))
        os.lseek(codefd, 0, os.SEEK_SET)
        limits = [codefd, int(drop), math.ceil(timeout_s) + 1, memory_mb << 20, MAX_PROCESSES,
                  MAX_FILE_BYTES, MAX_OPEN_FILES]
        argv = prefix_argv + ["-I", "-S", "-c", _BOOTSTRAP, *map(str, limits)]
        start = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(codefd,), start_new_session=True, cwd=cwd,
                                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    finally:
        os.close(codefd)

    out, err = _Capped(OUTPUT_CAP), _Capped(OUTPUT_CAP)
    deadline = start + timeout_s
    timed_out = over_memory = False
    bound, peak = memory_mb << 20, 0
    next_check = start
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        while sel.get_map():
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                timed_out = proc.poll() is None
                break
            if now >= next_check and proc.poll() is None:  # the whole run's memory, all processes together
                used = sum(_memory_bytes(pid) for pid in _descendants(proc.pid, drop))
                peak = max(peak, used)
                next_check = now + MEMORY_POLL_S
                if used > bound:
                    over_memory = True
                    _kill_all(proc.pid, drop)
                    break
            for key, _ in sel.select(max(0.0, min(left, next_check - time.monotonic(), 0.1))):
                data = os.read(key.fd, 1 << 16)
                if data:
                    key.data.add(data)
                else:
                    sel.unregister(key.fileobj)
            if proc.poll() is not None:  # exited: whatever still holds the pipes gets a short grace
                deadline = min(deadline, time.monotonic() + 0.5)
    # Kill what is left of the run while the (possibly zombie) leader still reserves its pgid.
    _kill_all(proc.pid, drop)
    proc.wait()
    seconds = time.monotonic() - start
    proc.stdout.close()
    proc.stderr.close()

    rc = proc.returncode
    # bwrap reports a child killed by signal N as exit code 128 + N (like a shell).
    sig = -rc if rc < 0 else (rc - 128 if drop and 128 < rc < 128 + 65 else 0)
    stderr = err.text()
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    out_of_memory = last.startswith("MemoryError") or (
        sig in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS)
        and any(s in stderr for s in ("MemoryError", "Cannot allocate memory", "out of memory")))
    if over_memory:
        status = "memory"
        stderr += f"\n[laneplay sandbox: the run's processes together went past {memory_mb} MB and were killed]\n"
    elif timed_out or sig == signal.SIGXCPU:
        status = "timeout"
    elif out_of_memory:
        status = "memory"
    elif sig:
        status = "killed"
    else:
        status = "ok" if rc == 0 else "error"
    return Result(status, out.text(), stderr, -sig if sig else rc, seconds,
                  truncated=bool(out.dropped or err.dropped),
                  peak_memory_mb=math.ceil(peak * 10 / 2**20) / 10)  # up: a run killed past its bound reads past it
