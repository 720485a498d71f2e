"""Generated code is contained: each hostile program below gets its own test."""
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from laneplay.evals.sandbox import OUTPUT_CAP, SANDBOX_UID, SandboxUnavailable, run_python


def run(code, timeout_s=10.0, memory_mb=512):
    return run_python(code, timeout_s=timeout_s, memory_mb=memory_mb)


def attempt(expr_lines: str) -> str:
    """A program that prints OK:<what> if each attempt succeeds and BLOCKED:<what> when it raises."""
    return ("import os, socket, sys\n"
            "def attempt(what, fn):\n"
            "    try:\n"
            "        fn()\n"
            "        print('OK:' + what, flush=True)\n"
            "    except Exception as e:\n"
            "        print('BLOCKED:' + what, type(e).__name__, flush=True)\n" + expr_lines)


def test_plain_program_runs(sandboxed):
    r = run("import sys; print('hello'); print('oops', file=sys.stderr); raise SystemExit(3)")
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("error", 3, "hello\n", "oops\n")
    assert run("pass").status == "ok"


def test_identity_environment_and_capabilities(sandboxed, monkeypatch):
    monkeypatch.setenv("LANEPLAY_TEST_SECRET", "hunter2")
    r = run("import os\n"
            "print(os.getuid(), os.getgid(), os.getpid())\n"
            "print(sorted(os.environ))\n"
            "print([l.split()[1] for l in open('/proc/self/status') if l.startswith(('CapEff', 'NoNewPrivs'))])\n"
            "print(os.getcwd(), sys.flags.isolated if (sys := __import__('sys')) else 0)\n")
    assert r.status == "ok", r.stderr
    ids, env, caps, cwd = r.stdout.splitlines()
    uid, gid, pid = map(int, ids.split())
    assert (uid, gid) == (SANDBOX_UID, SANDBOX_UID)
    assert pid < 10  # its own PID namespace
    assert "hunter2" not in r.stdout and "LANEPLAY_TEST_SECRET" not in env
    assert eval(caps) == ["0000000000000000", "1"]
    assert cwd == "/tmp 1"


def test_network_is_unreachable(sandboxed):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted = []
    server.settimeout(0.2)

    def accept():
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            try:
                accepted.append(server.accept()[0])
            except (socket.timeout, OSError):
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # the server does work from here
        time.sleep(0.3)
        before = len(accepted)
        r = run(attempt(f"attempt('tcp', lambda: socket.create_connection(('127.0.0.1', {port}), timeout=3))\n"
                        "attempt('dns', lambda: socket.getaddrinfo('example.com', 80))\n"))
        time.sleep(0.3)
        assert "BLOCKED:tcp" in r.stdout and "OK:" not in r.stdout, r.stdout + r.stderr
        assert len(accepted) == before  # nothing from the sandbox ever arrived
    finally:
        server.close()
        for c in accepted:
            c.close()


def test_cannot_read_the_app_database(sandboxed, data_dir_tmp):
    db = data_dir_tmp / "laneplay.sqlite3"
    db.write_text("SECRET-SESSION-DATA")
    assert db.read_text() == "SECRET-SESSION-DATA"
    r = run(attempt(f"attempt('read', lambda: print(open({str(db)!r}).read()))\n"
                    f"attempt('list', lambda: print(os.listdir({str(data_dir_tmp.parent)!r})))\n"
                    f"attempt('cwd', lambda: print(os.listdir({str(Path.cwd())!r})))\n"))
    assert r.status == "ok", r.stderr
    assert "SECRET" not in r.stdout
    assert "BLOCKED:read" in r.stdout and "BLOCKED:list" in r.stdout and "BLOCKED:cwd" in r.stdout


def test_cannot_read_the_home_directory(sandboxed):
    home = Path.home()
    secret = home / f".laneplay-test-secret-{uuid.uuid4().hex}"
    secret.write_text("SECRET-IN-HOME")
    try:
        r = run(attempt(f"attempt('read', lambda: print(open({str(secret)!r}).read()))\n"
                        f"print('LISTING', sorted(os.listdir({str(home)!r})) if os.path.isdir({str(home)!r}) else None)\n"))
    finally:
        secret.unlink()
    assert r.status == "ok", r.stderr
    assert "SECRET-IN-HOME" not in r.stdout and secret.name not in r.stdout
    assert "BLOCKED:read" in r.stdout
    listing = eval(r.stdout.split("LISTING ", 1)[1])
    # At most the empty skeleton leading to a read-only interpreter prefix that lives under $HOME.
    prefix = Path(sys.base_prefix).resolve()
    allowed = {prefix.relative_to(home).parts[0]} if prefix.is_relative_to(home) else set()
    assert listing is None or set(listing) <= allowed, listing


def test_cannot_write_outside_the_working_directory(sandboxed):
    here = Path.cwd()
    marker = f"laneplay-escape-{uuid.uuid4().hex}"
    targets = ["/", "/usr", "/etc", "/root", "/home", "/dev/shm", "/var/tmp", str(here), str(Path.home()),
               sys.base_prefix, os.path.dirname(sys.executable)]
    lines = "".join(f"attempt({t!r}, lambda: open(os.path.join({t!r}, {marker!r}), 'w').write('x'))\n"
                    for t in targets)
    r = run(attempt(lines + f"attempt('workdir', lambda: open({marker!r}, 'w').write('x'))\n"))
    assert r.status == "ok", r.stderr
    assert "OK:workdir" in r.stdout
    assert r.stdout.count("BLOCKED:") == len(targets), r.stdout
    for t in targets:
        assert not os.path.exists(os.path.join(t, marker))


def test_private_tmp(sandboxed, tmp_path):
    (tmp_path / "host-file").write_text("x")
    r = run(f"import os; print(os.path.exists({str(tmp_path / 'host-file')!r}), sorted(os.listdir('/tmp')))")
    assert r.stdout.split(" ", 1)[0] == "False"


def test_process_limit_stops_a_fork_bomb(sandboxed):
    # Count how many children fit before fork() fails: bounded by RLIMIT_NPROC, not by the machine.
    counted = run("import os, time\n"
                  "n = 0\n"
                  "while True:\n"
                  "    try:\n"
                  "        if os.fork() == 0:\n"
                  "            time.sleep(30); os._exit(0)\n"
                  "        n += 1\n"
                  "    except OSError:\n"
                  "        break\n"
                  "print(n)\n", timeout_s=10)
    assert counted.status == "ok", counted.stderr
    assert 1 <= int(counted.stdout) <= 64
    t = time.monotonic()
    bomb = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", timeout_s=3)
    assert bomb.status in ("timeout", "killed", "error")
    assert time.monotonic() - t < 10
    assert run("print('still usable')").stdout == "still usable\n"


def test_memory_limit(sandboxed):
    r = run("x = bytearray(4 << 30)\nprint(len(x))", memory_mb=512)
    assert r.status == "memory", (r.status, r.stderr)
    assert "MemoryError" in r.stderr


def test_wall_clock_deadline(sandboxed):
    r = run("while True:\n    pass\n", timeout_s=2)
    assert r.status == "timeout"
    assert 1.9 <= r.seconds <= 3.5, r.seconds


def test_everything_is_killed_at_the_deadline(sandboxed):
    marker = f"laneplay-sleeper-{uuid.uuid4().hex}"
    r = run("import os, sys, time\n"
            "for _ in range(3):\n"
            "    if os.fork() == 0:\n"
            f"        os.execv(sys.executable, [sys.executable, '-S', '-c', 'import time; time.sleep(60)', {marker!r}])\n"
            "time.sleep(60)\n", timeout_s=1)
    assert r.status == "timeout" and r.seconds < 2.5
    deadline = time.monotonic() + 2
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(marker) == []


def test_filling_tmp_is_bounded(sandboxed):
    r = run("import os\n"
            "written = 0\n"
            "try:\n"
            "    for i in range(64):\n"
            "        with open(f'f{i}', 'wb') as f:\n"
            "            for _ in range(8):\n"
            "                f.write(b'x' * (1 << 20)); f.flush(); written += 1 << 20\n"
            "except OSError as e:\n"
            "    print('stopped', e.errno)\n"
            "print(written >> 20)\n", timeout_s=20, memory_mb=256)
    assert r.status == "ok", r.stderr
    assert r.stdout.startswith("stopped") and int(r.stdout.split()[-1]) <= 64  # MiB: the tmpfs size cap


def test_huge_output_is_truncated_quickly(sandboxed):
    t = time.monotonic()
    r = run("import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)\n"
            "print('END')\nsys.stderr.write('e' * (50 << 20) + 'TAIL')\n", timeout_s=30)
    assert time.monotonic() - t < 15
    assert r.status == "ok" and r.truncated
    assert len(r.stdout) < OUTPUT_CAP + 200 and len(r.stderr) < OUTPUT_CAP + 200
    assert r.stdout.startswith("xxx") and r.stdout.endswith("END\n")  # head and tail are kept
    assert "bytes dropped" in r.stdout and r.stderr.endswith("TAIL")


def test_signals_cannot_reach_outside(sandboxed):
    # A bystander running under the same host uid as the sandboxed code (root mode: 65534).
    as_uid = SANDBOX_UID if os.geteuid() == 0 else None
    bystander = subprocess.Popen(["sleep", "60"], user=as_uid, start_new_session=True)
    try:
        r = run(attempt(f"import signal\n"
                        f"attempt('kill-bystander', lambda: os.kill({bystander.pid}, signal.SIGKILL))\n"
                        f"attempt('kill-parent', lambda: os.kill(os.getppid(), signal.SIGKILL))\n"
                        f"attempt('kill-1', lambda: os.kill(1, signal.SIGKILL))\n"
                        f"attempt('kill-test-process', lambda: os.kill({os.getpid()}, signal.SIGKILL))\n"
                        f"attempt('killpg-test', lambda: os.killpg({os.getpgrp()}, signal.SIGKILL))\n"
                        f"os.kill(-1, signal.SIGKILL)\n"
                        f"os.killpg(0, signal.SIGKILL)\n"))
        time.sleep(0.2)
        assert bystander.poll() is None  # still running
        assert r.status in ("killed", "ok", "error")
        assert "OK:kill-bystander" not in r.stdout and "OK:kill-test-process" not in r.stdout
        assert run("print(1)").stdout == "1\n"
    finally:
        bystander.kill()
        bystander.wait()


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


def test_daemonized_child_does_not_survive(sandboxed):
    marker = f"laneplay-daemon-{uuid.uuid4().hex}"
    code = ("import os, sys, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            f"        os.execv(sys.executable, [sys.executable, '-S', '-c', 'import time; time.sleep(60)', {marker!r}])\n"
            "    os._exit(0)\n"
            "for _ in range(100):  # wait until the daemon is really running\n"
            "    if any(b'%s' in open(f'/proc/{p}/cmdline', 'rb').read() for p in os.listdir('/proc') if p.isdigit()):\n"
            "        print('daemon running'); break\n"
            "    time.sleep(0.05)\n" % marker)
    r = run(code)
    assert r.status == "ok" and r.stdout == "daemon running\n", r.stderr
    deadline = time.monotonic() + 2
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(marker) == []


def test_refuses_to_run_without_bubblewrap(monkeypatch):
    from laneplay.evals import sandbox

    monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)
    monkeypatch.setattr(sandbox.shutil, "which", lambda name, *a, **k: None)
    sandbox._bwrap_argv.cache_clear()
    sandbox.sandbox_available.cache_clear()
    try:
        ok, reason = sandbox.sandbox_available()
        assert not ok and "apt-get install bubblewrap" in reason
        with pytest.raises(SandboxUnavailable, match="install bubblewrap"):
            run_python("print('should not run')", 5, 256)
    finally:
        sandbox._bwrap_argv.cache_clear()
        sandbox.sandbox_available.cache_clear()


def test_unsafe_opt_out_is_explicit_and_loud(monkeypatch, capsys):
    from laneplay.evals import sandbox

    monkeypatch.setenv(sandbox.UNSAFE_ENV, "1")
    monkeypatch.setattr(sandbox.shutil, "which", lambda name, *a, **k: None)  # no bwrap: still runs
    sandbox._bwrap_argv.cache_clear()
    sandbox._warn_unsafe.cache_clear()
    try:
        r = run_python("print(6 * 7)", 5, 256)
        assert r.status == "ok" and r.stdout == "42\n"
        assert "WITHOUT the bubblewrap sandbox" in capsys.readouterr().err
    finally:
        sandbox._bwrap_argv.cache_clear()
        sandbox.sandbox_available.cache_clear()


@pytest.mark.parametrize("kwargs", [dict(code=b"print(1)"), dict(code="x", timeout_s=0), dict(code="x", timeout_s=1e9),
                                    dict(code="x", memory_mb=1), dict(code="x" * (9 << 20))])
def test_rejects_bad_arguments(kwargs):
    args = dict(code="pass", timeout_s=5, memory_mb=256) | kwargs
    with pytest.raises((TypeError, ValueError)):
        run_python(**args)


def _mem_available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


def test_memory_bounds_the_whole_run_not_each_forked_process(sandboxed):
    # 20 forked children, each touching 200 MB, under memory_mb=256: per-process limits alone let this
    # take ~4 GB from the host. The run together must stay near its bound and end as "memory".
    marker = f"laneplay-forkalloc-{uuid.uuid4().hex}"
    child = "x = b'x' * (200 << 20); import time; time.sleep(30)"
    code = ("import os, sys, time\n"
            "for _ in range(20):\n"
            "    try:\n"
            "        if os.fork() == 0:\n"
            f"            os.execv(sys.executable, [sys.executable, '-S', '-c', {child!r}, {marker!r}])\n"
            "    except OSError:\n"
            "        pass\n"
            "time.sleep(30)\n")
    baseline, lowest, done = _mem_available_mb(), [float("inf")], threading.Event()

    def watch():  # an independent view of what the host lost, sampled while the run is alive
        while not done.is_set():
            lowest[0] = min(lowest[0], _mem_available_mb())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        r = run(code, timeout_s=20, memory_mb=256)
    finally:
        done.set()
        watcher.join()
    taken = baseline - lowest[0]
    print(f"fork x allocation: status {r.status}, watcher peak {r.peak_memory_mb} MB, host lost at most "
          f"{taken:.0f} MB, {r.seconds:.2f} s")
    assert r.status == "memory", (r.status, r.stderr[-500:])
    assert r.seconds < 10
    assert 256 < r.peak_memory_mb < 1024
    assert taken < 1024, f"the host lost {taken:.0f} MB to a run bounded at 256 MB"
    deadline = time.monotonic() + 2
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(marker) == []  # nothing outlives the run


def test_forked_workers_within_the_bound_run_normally(sandboxed):
    code = ("import os\n"
            "kids = []\n"
            "for i in range(4):\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        x = b'y' * (20 << 20)\n"
            "        os._exit(0)\n"
            "    kids.append(pid)\n"
            "print(all(os.waitpid(k, 0)[1] == 0 for k in kids))\n")
    r = run(code, timeout_s=20, memory_mb=256)
    assert r.status == "ok" and r.stdout.strip() == "True", (r.status, r.stderr)
