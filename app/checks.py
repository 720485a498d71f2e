"""Running generated code against tests from the app: always in the sandbox, at most one program per core.

Every tab that runs code (Side by side's "run tests", pass@N's jobs) goes through `check_code`, so the
bound holds across tabs, browsers and jobs together: a program waits for a free slot rather than
starting an (n+1)-th sandbox on n cores.
"""
from __future__ import annotations

import asyncio
import os
import threading

from laneplay.evals.execution import SampleOutcome, check
from laneplay.evals.problems import Problem
from laneplay.evals.sandbox import sandbox_available

SLOTS = max(1, os.cpu_count() or 1)
_slots = threading.BoundedSemaphore(SLOTS)


def sandbox_status() -> tuple[bool, str]:
    """(usable, why not); probed once per process (the probe starts a sandbox)."""
    return sandbox_available()


class SandboxMissing(RuntimeError):
    """The sandbox cannot run here: nothing is executed, and the tab says why."""


def _check_blocking(problem: Problem, code: str, timeout_s: float) -> SampleOutcome:
    with _slots:
        return check(problem, code, timeout_s=timeout_s)


async def check_code(problem: Problem, code: str, timeout_s: float = 10.0) -> SampleOutcome:
    """Check `code` (a whole candidate program) against `problem`'s tests in the sandbox, off the event loop."""
    ok, why = sandbox_status()
    if not ok:
        raise SandboxMissing(f"The sandbox is unavailable, so no generated code runs: {why}")
    return await asyncio.to_thread(_check_blocking, problem, code, timeout_s)
