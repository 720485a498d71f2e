"""Prompt building and code extraction (base and instruct modes)."""
from laneplay.evals.execution import check
from laneplay.evals.problems import humaneval, user_problem
from laneplay.evals.prompting import (STOP_SEQUENCES, chat_messages, extract_code, extract_completion,
                             truncate_completion)

HE = {p.task_id: p for p in humaneval()}
P0 = HE["HumanEval/0"]  # has_close_elements, prompt imports List
SOLUTION = (
    "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
    "    for i, a in enumerate(numbers):\n"
    "        for b in numbers[i + 1:]:\n"
    "            if abs(a - b) < threshold:\n"
    "                return True\n"
    "    return False\n")


# ---- base (completion) mode -------------------------------------------------------------------

def test_truncation_at_top_level_stop_sequences():
    body = "    x = 1\n    # an indented comment stays\n    def inner():\n        return x\n    return inner()\n"
    for tail in ["\ndef other():\n    pass\n", "\nif __name__ == '__main__':\n    main()\n",
                 "\nprint(f(1))\n", "\n# test\n", "\nclass A:\n    pass\n", "\nassert f(1) == 1\n",
                 "\n```\nSome prose.", "\n@decorator\ndef g(): pass\n"]:
        assert truncate_completion(body + tail) == body, tail
    assert truncate_completion(body) == body
    assert truncate_completion("    return 1\r\ndef g():\r\n") == "    return 1"
    assert "\ndef " in STOP_SEQUENCES


def test_completion_mode_program_passes():
    completion = P0.canonical_solution + "\n\ndef check_it():\n    assert False\n\nprint(has_close_elements([], 1))\n"
    ex = extract_completion(P0, completion)
    assert ex.method == "completion"
    assert ex.code == P0.prompt + P0.canonical_solution + "\n"
    assert "check_it" not in ex.code and "print(" not in ex.code
    assert check(P0, ex.code).status == "pass"
    assert extract_completion(P0, "").warnings == ["empty completion"]


# ---- instruct (chat) mode ---------------------------------------------------------------------

def test_chat_message_contains_the_prompt_in_a_fence():
    (msg,) = chat_messages(P0)
    assert msg["role"] == "user"
    assert "```python\n" + P0.prompt.strip() + "\n```" in msg["content"]
    prose = user_problem("Write a function add(a, b) that returns the sum.", "assert add(1, 2) == 3", "add")
    assert "`add`" in chat_messages(prose)[0]["content"]


def test_single_fenced_block():
    answer = f"Here is the solution:\n\n```python\nfrom typing import List\n\n{SOLUTION}```\n\nIt loops over pairs."
    ex = extract_code(P0, answer)
    assert ex.method == "fenced" and ex.warnings == []
    assert ex.code.strip() == f"from typing import List\n\n{SOLUTION}".strip()
    assert check(P0, ex.code).status == "pass"


def test_multiple_blocks_picks_the_one_defining_the_entry_point():
    answer = ("First install nothing:\n```bash\npip install nothing\n```\n"
              "A helper idea:\n```python\ndef helper(x):\n    return x\n```\n"
              f"The function:\n```python\nfrom typing import List\n{SOLUTION}```\n"
              "And a wrong variant:\n```python\ndef has_close_elements(numbers, threshold):\n    return False\n```\n")
    ex = extract_code(P0, answer)
    assert ex.method == "fenced" and "abs(a - b)" in ex.code and "helper" not in ex.code
    assert check(P0, ex.code).status == "pass"


def test_block_without_entry_point_is_used_with_a_warning():
    ex = extract_code(P0, "```\nprint('hi')\nx = 1\n```")
    assert ex.method == "fenced" and any("no code block defines" in w for w in ex.warnings)


def test_unterminated_fence_is_still_found():
    ex = extract_code(P0, f"```python\nfrom typing import List\n{SOLUTION}")
    assert ex.method == "fenced" and check(P0, ex.code).status == "pass"


def test_no_fence_takes_the_longest_parsable_span():
    answer = (f"Sure! The idea is to compare every pair.\n\nfrom typing import List\n\n{SOLUTION}\n"
              "This runs in O(n^2) time, which is fine for small inputs.\n")
    ex = extract_code(P0, answer)
    assert ex.method == "span"
    assert ex.code.startswith("from typing import List") and "O(n^2)" not in ex.code
    assert check(P0, ex.code).status == "pass"
    assert extract_code(P0, "I don't know how to do that.").method == "none"


def test_missing_imports_and_helpers_come_from_the_prompt():
    ex = extract_code(P0, f"```python\n{SOLUTION}```")  # uses List without importing it
    assert ex.code.startswith("from typing import List")
    assert any("from the prompt" in w for w in ex.warnings)
    assert check(P0, ex.code).status == "pass"

    p38 = HE["HumanEval/38"]  # decode_cyclic; its test calls the prompt's helper encode_cyclic
    answer = "```python\ndef decode_cyclic(s: str):\n    return encode_cyclic(encode_cyclic(s))\n```"
    ex = extract_code(p38, answer)
    assert "def encode_cyclic" in ex.code
    assert check(p38, ex.code).status == "pass"


def test_demo_code_is_dropped():
    answer = (f"```python\nfrom typing import List\n{SOLUTION}\n"
              "n = int(input())\n"  # kept: a top-level assignment (stdin is closed, so this one fails)
              "print(has_close_elements([1.0, 2.0], 0.5))\n"
              "assert has_close_elements([1.0], 1.0) is True\n"
              "if __name__ == '__main__':\n    import sys\n    sys.exit(1)\n```")
    ex = extract_code(P0, answer)
    assert "print(" not in ex.code and "__main__" not in ex.code and "assert has_close" not in ex.code
    assert any("dropped 3" in w for w in ex.warnings)
    cleaned = extract_code(P0, answer.replace("n = int(input())\n", ""))
    assert check(P0, cleaned.code).status == "pass"


def test_decorated_and_async_definitions_are_kept():
    p = user_problem("def twice(x):\n    '''Return 2x.'''\n", "assert twice(3) == 6")
    answer = ("```python\nimport functools\n\n@functools.lru_cache(maxsize=None)\ndef twice(x):\n    return 2 * x\n\n"
              "async def unused():\n    pass\n```")
    ex = extract_code(p, answer)
    assert "@functools.lru_cache" in ex.code and "async def unused" in ex.code
    assert check(p, ex.code).status == "pass"
