"""What the model is asked, and which code is taken from its answer.

Base (completion) mode: the model continues the problem prompt; the program is prompt + completion,
cut at the first top-level stop sequence (human-eval/Codex convention: a newline followed directly by
`def`, `class`, `if`, `print(`, `#`, ... means the function body has ended).

Instruct (chat) mode: one user message with the prompt in a code fence; the code is the first
```python block that defines the entry point, else any fenced block, else the longest span of lines
that parses. Top-level demo code (prints, asserts, `if __name__ == "__main__":`, loops) is dropped, and
imports/helper functions the prompt had are put back when the answer left them out.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from laneplay.evals.problems import Problem


def _parse(code: str) -> ast.Module:
    """ast.parse; CPython 3.11 can raise a spurious "AST constructor recursion depth mismatch"
    SystemError (fixed upstream in 3.12): parse once more, then report it as unparsable code."""
    for attempt in (1, 2):
        try:
            return ast.parse(code)
        except SystemError as e:
            if attempt == 2:
                raise SyntaxError(f"the parser failed on this code ({e})") from None
    raise AssertionError("unreachable")

# Cut points for base-mode completions; also useful as the engine's `stop` list.
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#", "\n@", "\nassert ", "\n```")
MAX_SPAN_LINES = 400  # the no-fence span search is quadratic in the worst case
_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.M | re.S)
_PYTHON_TAGS = {"", "python", "py", "python3", "py3"}


@dataclass
class Extraction:
    code: str  # the candidate program (without the tests)
    method: str  # "completion" | "fenced" | "span" | "none"
    warnings: list[str] = field(default_factory=list)


def truncate_completion(completion: str) -> str:
    """Cut a base-mode completion at the first top-level stop sequence."""
    text = completion.replace("\r\n", "\n")
    cut = min((i for i in (text.find(s) for s in STOP_SEQUENCES) if i >= 0), default=len(text))
    return text[:cut]


def completion_prompt(problem: Problem) -> str:
    return problem.prompt


def chat_messages(problem: Problem) -> list[dict[str, str]]:
    """The chat for instruct mode (the model's chat template is applied by the engine)."""
    if _parses(problem.prompt) and re.search(rf"\bdef\s+{re.escape(problem.entry_point)}\s*\(", problem.prompt):
        content = f"Complete the following Python function:\n```python\n{problem.prompt.strip()}\n```"
    else:  # an instruction in prose (MBPP-style or typed by a user)
        content = (f"{problem.prompt.strip()}\n\nWrite the solution as a Python function named "
                   f"`{problem.entry_point}`.")
    return [{"role": "user", "content": content + "\nAnswer with the complete function in one ```python code block."}]


def extract_completion(problem: Problem, completion: str) -> Extraction:
    """Base mode: prompt + the completion cut at the first stop sequence."""
    body = truncate_completion(completion)
    warnings = [] if body.strip() else ["empty completion"]
    return Extraction(problem.prompt + body, "completion", warnings)


def extract_code(problem: Problem, answer: str) -> Extraction:
    """Instruct mode: find the code in a chat answer (see the module docstring for the order)."""
    entry, warnings = problem.entry_point, []
    answer = answer.replace("\r\n", "\n")
    blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(answer)]
    python_blocks = [b for tag, b in blocks if tag in _PYTHON_TAGS]
    chosen = next((b for b in python_blocks + [b for _, b in blocks] if _defines(b, entry)), None)
    if chosen is not None:
        code, method = chosen, "fenced"
    elif blocks:
        code, method = (python_blocks or [blocks[0][1]])[0], "fenced"
        warnings.append(f"no code block defines {entry}(); using the first block")
    else:
        code, method = _longest_parsable_span(answer), "span"
        if not code.strip():
            return Extraction("", "none", ["no code found in the answer"])
    code = _keep_definitions(code, warnings)
    code = _restore_from_prompt(problem, code, warnings)
    if not _defines(code, entry):
        warnings.append(f"the extracted code does not define {entry}()")
    return Extraction(code, method, warnings)


def _parses(code: str) -> bool:
    try:
        _parse(code)
        return True
    except (SyntaxError, ValueError):
        return False


def _defines(code: str, name: str) -> bool:
    return re.search(rf"^[ \t]*(?:async\s+)?def\s+{re.escape(name)}\s*\(", code, re.M) is not None


def _longest_parsable_span(text: str) -> str:
    """The longest run of lines that parses and starts like code (evalplus-sanitize style)."""
    lines = text.split("\n")[:MAX_SPAN_LINES]
    starts = [i for i, line in enumerate(lines)
              if re.match(r"(?:async\s+def|def|class|import|from|@)\b", line)]
    best = ""
    for i in starts:
        for j in range(len(lines), i, -1):  # longest first: the first span that parses wins for this start
            if j - i <= best.count("\n") + 1:
                break
            span = "\n".join(lines[i:j])
            if _parses(span):
                best = span
                break
    return best


def _is_demo(node: ast.stmt) -> bool:
    """Top-level statements that exercise the code rather than define it."""
    if isinstance(node, ast.Expr):
        return not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, str))
    if isinstance(node, ast.If):
        return "__name__" in ast.unparse(node.test)
    return isinstance(node, (ast.Assert, ast.For, ast.AsyncFor, ast.While))


def _keep_definitions(code: str, warnings: list[str]) -> str:
    """Drop top-level demo code (print calls, asserts, main blocks, loops); keep the rest verbatim."""
    try:
        tree = _parse(code)
    except (SyntaxError, ValueError) as e:
        warnings.append(f"the extracted code does not parse: {getattr(e, 'msg', e)}")
        return code
    lines = code.split("\n")
    dropped = [node for node in tree.body if _is_demo(node)]
    if not dropped:
        return code
    for node in dropped:
        lines[node.lineno - 1:node.end_lineno] = [None] * (node.end_lineno - node.lineno + 1)
    warnings.append(f"dropped {len(dropped)} top-level statement(s) that run code (prints, asserts, main block)")
    return "\n".join(line for line in lines if line is not None)


def _restore_from_prompt(problem: Problem, code: str, warnings: list[str]) -> str:
    """Prepend the prompt's imports and helper functions that the answer does not have."""
    try:
        prompt_tree, code_tree = _parse(problem.prompt), _parse(code)
    except (SyntaxError, ValueError):
        return code
    bound = _bound_names(code_tree)
    lines = problem.prompt.split("\n")
    missing = []
    for node in prompt_tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not _bound_names(node) <= bound:
            missing.append(ast.unparse(node))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and node.name != problem.entry_point and node.name not in bound:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            missing.append("\n".join(lines[first - 1:node.end_lineno]))
    if not missing:
        return code
    warnings.append(f"added {len(missing)} import(s)/helper(s) from the prompt")
    return "\n".join(missing) + "\n\n" + code


def _bound_names(node: ast.AST) -> set[str]:
    """Names that top-level imports and definitions in `node` (a module or one statement) bind."""
    names = set()
    for stmt in node.body if isinstance(node, ast.Module) else [node]:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.split(".")[0] for a in stmt.names}
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
    return names
