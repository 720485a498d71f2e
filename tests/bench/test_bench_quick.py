"""`laneplay bench --quick` end to end: it runs in CI's time and writes JSON of the documented shape (the
numbers' speed is never checked here); a busy machine is refused before anything is loaded."""
import json
import math
import subprocess
import sys

import pytest

from laneplay.bench import cli, common, decode
from laneplay.engine.runtime import PREFILL_CHUNK
from laneplay.kernels import lowbit

LONG = 160  # --quick's long prompt: smoke-sized, but still more than one prefill chunk


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_quick_bench_writes_every_table_as_json(tmp_path):
    assert LONG > PREFILL_CHUNK and f"short,{LONG}" in cli.QUICK["decode"] and str(LONG) in cli.QUICK["prefill"]
    # -P and another cwd: the repository's folders must not shadow installed packages (HF's `kernels`)
    proc = subprocess.run([sys.executable, "-P", "-m", "laneplay", "bench", "--quick", "--allow-noisy", "--peers",
                           "transformers,llama.cpp", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in tmp_path.glob("*.json")} == {"decode-cpu.json", "dtp-cpu.json", "prefill-cpu.json"}
    for path in tmp_path.glob("*.json"):
        d = json.loads(path.read_text())
        assert d["schema"] == 2 and isinstance(d["noisy"], bool) and len(d["quiet"]) == 2, path.name
        assert {"cpu", "cores", "torch", "threads"} <= set(d["machine"]) and d["when"]
        assert d["rows"], path.name
    dec = json.loads((tmp_path / "decode-cpu.json").read_text())
    engines = {(r["engine"], r["prompt"]) for r in dec["rows"]}
    ours = ("ours (eager)", "ours (int4)") if lowbit.available() else ("ours (eager)",)
    served = ("ours (int4, served)",) if lowbit.available() else ()  # through `laneplay engine` over HTTP
    prompts = ("short", str(LONG))
    assert engines == {(e, p) for e in (*ours, *served, "transformers (eager)") for p in prompts} or \
        engines == {(e, p) for e in (*ours, *served, "transformers (eager)", "llama.cpp (Q4_1)") for p in prompts}
    assert {(s["engine"], s["prompt"]) for s in dec["split"]} == {(e, p) for e in ours for p in prompts}
    for s in dec["split"]:
        assert all(_positive(s[k]) for k in ("step_ms", "matrices_ms", "attention_ms")), s
    for r in dec["rows"]:
        assert all(_positive(r[k]) for k in ("ttft_ms", "decode_tps", "ms_per_token", "gbps", "roofline_frac",
                                             "bytes_per_token")), r
        assert r["new"] == 4 and (r["prompt"] == "short" or r["prompt_tokens"] == LONG)
        assert _positive(r["vs_transformers"])
    if not any(e.startswith("llama.cpp") for e, _ in engines):  # not installed: said so, not silently dropped
        assert any("llama.cpp peer skipped" in n for n in dec["notes"]) and "llama.cpp peer skipped" in proc.stdout
    assert [b["n"] for b in dec["batched"]] == [1, 2, 4]
    assert all(_positive(b["per_sample_tps"]) and _positive(b["aggregate_tps"]) for b in dec["batched"])
    assert _positive(dec["bandwidth"]["read_gbps"])
    dtp = json.loads((tmp_path / "dtp-cpu.json").read_text())
    assert [r["world"] for r in dtp["rows"]] == [1, 2, 2, 2] and all(_positive(r["ms_per_token"]) for r in dtp["rows"])
    pre = json.loads((tmp_path / "prefill-cpu.json").read_text())
    assert {r["prompt"] for r in pre["rows"]} == {LONG}
    assert {"ours (int4)", "transformers"} <= {r["engine"] for r in pre["rows"]}  # the CPU's default path, the peer
    assert all(_positive(r["ttft_ms"]) and _positive(r["prompt_tps"]) for r in pre["rows"])


def test_a_busy_machine_is_refused_before_anything_loads(monkeypatch, capsys):
    monkeypatch.setattr(common, "other_busy_cores", lambda seconds=1.5: 1.7)
    monkeypatch.setattr(decode, "check_quiet", common.check_quiet)
    with pytest.raises(SystemExit) as e:
        decode.main(["--rounds", "1"])
    assert e.value.code == 3
    assert "REFUSING" in capsys.readouterr().err


def test_a_busy_machine_with_allow_noisy_is_flagged(monkeypatch, capsys):
    monkeypatch.setattr(common, "other_busy_cores", lambda seconds=1.5: 1.2)
    record = common.check_quiet(True)
    assert record["quiet"] is False and record["other_busy_cores"] == 1.2
    assert "NOISY" in capsys.readouterr().err
    monkeypatch.setattr(common, "other_busy_cores", lambda seconds=1.5: 0.02)
    assert common.check_quiet(False)["quiet"] is True


def test_the_readme_tables_are_generated_from_the_json(tmp_path):
    from laneplay.bench.report import report

    assert report(tmp_path) == "No results yet: run `make bench`."
    row = {"engine": "llama.cpp (Q4_1)", "prompt": "short", "prompt_tokens": 42, "ttft_ms": 182.0, "decode_tps": 91.3,
           "ms_per_token": 11.0, "roofline_frac": 0.34, "vs_transformers": 6.71, "vs_llama_cpp": 1.0}
    (tmp_path / "decode-cpu.json").write_text(json.dumps({"when": "2026-12-04T16:00:00", "noisy": True, "rows": [row],
                                                         "machine": {"cpu": "x", "cores": 2, "torch": "2"},
                                                         "bandwidth": {"read_gbps": 26.7},
                                                         "batched": [{"engine": "n=4", "per_sample_tps": 7.5,
                                                                      "aggregate_tps": 30.1, "step_cost_vs_n1": 2.55}]}))
    text = report(tmp_path)
    assert "| llama.cpp (Q4_1) | 42 | 182 | 91.3 | 11.0 | 34% | 6.71 | 1.00 |" in text
    assert "| n=4 | 7.5 | 30.1 | 2.55 |" in text and "flagged noisy" in text and "26.7 GB/s" in text
    (tmp_path / "lowbit-quality.json").write_text(json.dumps({
        "when": "2026-12-05", "corpus": "HumanEval", "problems": "humaneval",
        "agreement": [{"dtype": "int4", "positions": 100, "top1_agreement": 0.97, "max_abs_dlogit": 1.5,
                       "mean_abs_dlogit": 0.12}],
        "humaneval": [{"dtype": "float32", "problems": 164, "greedy_pass1": 0.061},
                      {"dtype": "int4", "problems": 164, "greedy_pass1": 0.067}]}))
    text = report(tmp_path)
    assert "| int4 | 100 | 97.00% | 1.500 | 0.1200 |" in text and "| int4 | 164 | 0.067 |" in text


def test_the_serving_tables_are_generated_from_the_json(tmp_path):
    from laneplay.bench.report import report

    machine = {"cpu": "x", "cores": 2, "torch": "2"}
    (tmp_path / "batching.json").write_text(json.dumps({
        "when": "2026-12-06", "machine": machine, "dtype": "int4", "tokens": 128, "quiet": {"quiet": False},
        "step_costs": [{"requests": 4, "ms_per_step": 14.3, "vs_one": 2.01, "ms_per_row": 3.57}],
        "users": [{"engine": "batched", "users": 4, "ttft_min_ms": 90, "ttft_median_ms": 242, "ttft_max_ms": 369,
                   "wall_s": 3.57, "wall_vs_alone": 2.66, "wall_vs_slowest_alone": 1.91, "mean_done_s": 2.9,
                   "mean_done_vs_alone": 1.5, "worst_vs_own_alone": 1.72, "rows_per_step": 4.0}],
        "copies": [{"prompt": 0, "users": 4, "acceptance": 0.97, "alone_ttft_ms": 16.2, "ttft_max_ms": 41.0,
                    "alone_s": 0.31, "wall_s": 0.78, "wall_vs_alone": 2.52},
                   {"prompt": 1, "users": 4, "acceptance": None, "alone_ttft_ms": 15.0, "ttft_max_ms": 40.0,
                    "alone_s": 0.5, "wall_s": 0.9, "wall_vs_alone": 1.8}],
        "prefix_reuse": {"prompt_tokens": 1017, "cached_tokens": 512, "prefill_chunk": 512, "warm_ttft_ms": 1563,
                         "cold_ttft_ms": 2896, "warm_vs_cold": 0.54}}))
    (tmp_path / "serving.json").write_text(json.dumps({
        "when": "2026-12-06", "machine": machine, "requests": 16, "threads": 2, "mean_alone_s": 5.0,
        "rows": [{"server": "llama-server", "load": 4.0, "ttft_p50_ms": 300.0, "ttft_p99_ms": 2000.0,
                  "tbt_p50_ms": 20.0, "tbt_p99_ms": 90.0, "user_tps_median": 40.0, "aggregate_tps": 120.0}]}))
    (tmp_path / "batching-dtp.json").write_text(json.dumps({
        "when": "2026-12-06", "machine": machine, "dtype": "int4", "world_size": 3, "tokens": 64,
        "quiet": {"quiet": True},
        "users": [{"engine": "batched by the ranks", "users": 4, "ttft_min_ms": 364, "ttft_median_ms": 1086,
                   "ttft_max_ms": 1543, "wall_s": 17.16, "wall_vs_alone": 2.2, "rows_per_step": 4.0}]}))
    text = report(tmp_path)
    assert "The same request from 4 clients at once" in text and "| 0 | 0.97 | 16 | 41 | 0.31 | 0.78 | 2.52 |" in text
    assert "| 1 | – | 15 | 40 | 0.50 | 0.90 | 1.80 |" in text  # a request that never drafted
    assert "| 4 | 14.3 | 2.01 | 3.57 |" in text and "| batched | 4 | 90 | 242 | 369 | 3.57 | 2.66 | 1.91 | 2.90 | 1.50 | 1.72 | 4.0 |" in text
    # a run from before the column: a dash in its place
    assert "on 3 DTP ranks (int4" in text and "| batched by the ranks | 4 | 364 | 1086 | 1543 | 17.16 | 2.20 | – | – | – | – | 4.0 |" in text
    assert "512 prompt tokens reused" in text and "(0.54)" in text and "flagged noisy" in text
    assert "| llama-server | 4 | 300 | 2000 | 20.0 | 90.0 | 40.0 | 120.0 |" in text
    # a run checked before and after (a list of records) is flagged when either check found the machine busy
    for name in ("batching.json", "batching-dtp.json", "serving.json"):
        (tmp_path / name).unlink()
    (tmp_path / "spec.json").write_text(json.dumps({
        "when": "2026-12-06", "machine": machine, "model": "m", "dtype": "int4",
        "quiet": [{"quiet": True}, {"quiet": False}],
        "edits": {"prompts": 40, "median_off_tps": 140.0, "median_on_tps": 190.0, "median_speedup": 1.43,
                  "min_speedup": 0.7, "acceptance": 0.61, "tokens_per_step": 2.15, "same_tokens": 40}}))
    text = report(tmp_path)
    assert "flagged noisy" in text and "| 40 | 140.0 | 190.0 | 1.43 |" in text


def test_bench_load_is_the_open_loop_serving_bench(monkeypatch):
    """`laneplay bench load` (the name the many-users issue gives it) runs bench/serving.py with its
    arguments; `python -m laneplay.bench.load --url` stays the burst against a running server."""
    import argparse

    from laneplay.bench import load, serving

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["load", "--quick", "--allow-noisy", "--out", "elsewhere"])
    seen = {}
    monkeypatch.setattr(serving, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    assert cli.run(args) == 0
    assert seen["argv"] == [*cli.QUICK["serving"], "--allow-noisy", "--out", "elsewhere"]
    assert "open-loop" in (serving.__doc__ or "").lower() and "--url" in (load.__doc__ or "")
