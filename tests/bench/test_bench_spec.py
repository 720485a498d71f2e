"""`laneplay bench spec --quick`: the edit corpus, the JSON of the documented shape and its README table
(the speed is never checked here; the greedy equality is: on the int4 default path it is exact)."""
import json

import pytest

from laneplay.bench import spec
from laneplay.bench.cli import QUICK
from laneplay.bench.report import spec_table
from laneplay.engine.speculative import K_MAX


def test_the_edit_corpus_has_the_four_kinds_over_humaneval():
    corpus = spec.edit_corpus(40)
    assert len(corpus) == 40 and [k for k, _ in corpus[:4]] == list(spec.KINDS)
    assert all(sum(k == kind for k, _ in corpus) == 10 for kind in spec.KINDS)
    bug = next(p for k, p in corpus if k == "fix bug")
    assert "Fix the bug on line" in bug and "```python\n" in bug
    rename = next(p for k, p in corpus if k == "rename")
    name = rename.split("`")[1]
    assert f"`{name}_value`" in rename and name in rename.split("```python\n")[1]
    assert '"""' not in next(p for k, p in corpus if k == "docstring").split("```python\n")[1]


@pytest.mark.slow
def test_quick_spec_bench_writes_its_json_and_table(tmp_path, monkeypatch):
    from laneplay.bench import common
    from laneplay.kernels import lowbit

    monkeypatch.setattr(common, "QUIET_WINDOW_S", 0.3)  # as `laneplay bench --quick` sets it
    assert spec.main([*QUICK["spec"], "--allow-noisy", "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "spec.json").read_text())
    assert d["edits"]["prompts"] == 4 and d["plain"]["prompts"] == 1 and isinstance(d["noisy"], bool)
    assert [r["kind"] for r in d["rows"]["edits"]] == list(spec.KINDS)
    for r in d["rows"]["edits"] + d["rows"]["plain"]:
        assert r["off_tps"] > 0 and r["on_tps"] > 0 and r["accepted_tokens"] <= r["draft_tokens"]
        assert r["decode_steps"] + r["accepted_tokens"] == r["tokens"] - 1 and r["repeatable"]
        if lowbit.available() and d["dtype"] == "int4":
            assert r["same_tokens"], r  # the fused verify is bit for bit the decode steps
    assert d["edits"]["acceptance"] is not None
    if d["verify_costs_ms"]:
        assert len(d["verify_costs_ms"]) == K_MAX + 1 and all(c > 0 for c in d["verify_costs_ms"])
        assert all(r["hindsight"] is None or r["hindsight"] >= 1.0 for r in d["rows"]["edits"])
    assert "| edits (HumanEval) | 4 |" in spec_table(d) and d["repeat"] == 1 and "fastest" not in spec_table(d)
    assert "each mode's fastest of 3 interleaved runs a prompt" in spec_table({**d, "repeat": 3})


def test_hindsight_verifies_exactly_what_will_be_kept():
    costs = [1.0 + 0.5 * (S - 1) for S in range(1, K_MAX + 2)]
    line = list(range(100, 130))
    # the answer copies the prompt's line: after the first token, a verify of 16 positions keeps its 15
    # drafts and adds a token, then one of 13 positions takes the last 13: 29 tokens for 8.5 + 7.0 step costs
    assert spec.hindsight(line, line, costs) == pytest.approx(29 / (costs[15] + costs[12]))
    assert spec.hindsight([1, 2, 3], [7, 8, 9, 10], costs) == 1.0  # nothing to look up: plain steps
    # a draft kept alone is not worth a verify that costs as much as the two plain steps it saves
    assert spec.hindsight([5, 6, 5, 6], [5, 6, 9], [1.0, 2.0, 3.0]) == 1.0


def test_replay_prices_autos_own_drafts_and_stays_under_hindsight():
    from types import SimpleNamespace

    runner = SimpleNamespace(verify=lambda *a: None)  # a runner with a verify step (and cheap rows)
    costs = [1.0 + 0.15 * (S - 1) for S in range(1, K_MAX + 2)]
    line = list(range(100, 140))
    assert spec.replay(runner, [1, 2, 3], [7, 8, 9, 10], costs, 16) == 1.0  # nothing repeats: plain steps
    copy = spec.replay(runner, line, line, costs, 64)
    assert 1.5 < copy <= spec.hindsight(line, line, costs)
    # dearer rows lower the rule's ratio on the same tokens
    assert spec.replay(runner, line, line, [1.0 + 0.6 * (S - 1) for S in range(1, K_MAX + 2)], 64) < copy
