"""The README's results tables, generated from bench/results/*.json (what the last runs measured).

    python -m laneplay.bench.report [--results DIR]

Prints Markdown: the decode table (ours vs transformers vs llama.cpp at each prompt length), batched
samples, where a step goes, the low-bit paths' quality against float32, the DTP A/B, many users on one
engine and open-loop serving against llama-server, each with the machine, date and whether the run
was flagged noisy.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from laneplay.bench.common import RESULTS


def _f(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def _head(d: dict) -> str:
    m = d.get("machine") or {}
    quiet = d.get("quiet") or {}
    records = quiet if isinstance(quiet, list) else [quiet]  # check_quiet records: one, or before and after
    noisy = d.get("noisy") or not all(r.get("quiet", True) for r in records)
    flag = " **(flagged noisy)**" if noisy else ""
    return f"{(d.get('when') or '')[:10]}, {m.get('cpu') or '?'} × {m.get('cores') or '?'} cores, torch {m.get('torch')}{flag}"


def decode_tables(d: dict) -> str:
    bw = (d.get("bandwidth") or {}).get("read_gbps")
    lines = [f"Decode, batch 1, greedy, {_head(d)}; read bandwidth {_f(bw, '.1f')} GB/s measured in the same run.", "",
             "| engine | prompt tokens | TTFT ms | decode tok/s | ms/token | share of roofline | vs transformers "
             "| vs llama.cpp |", "|---|---|---|---|---|---|---|---|"]
    for r in d.get("rows") or []:
        lines.append(f"| {r['engine']} | {r.get('prompt_tokens', r.get('prompt'))} | {_f(r.get('ttft_ms'), '.0f')} | "
                     f"{_f(r.get('decode_tps'), '.1f')} | {_f(r.get('ms_per_token'), '.1f')} | "
                     f"{_f(r.get('roofline_frac'), '.0%')} | {_f(r.get('vs_transformers'), '.2f')} | "
                     f"{_f(r.get('vs_llama_cpp'), '.2f')} |")
    if d.get("batched"):
        lines += ["", "| samples in one batch | tok/s per sample | aggregate tok/s | step time vs n=1 |",
                  "|---|---|---|---|"]
        lines += [f"| {b['engine']} | {_f(b.get('per_sample_tps'), '.1f')} | {_f(b.get('aggregate_tps'), '.1f')} | "
                  f"{_f(b.get('step_cost_vs_n1'), '.2f')} |" for b in d["batched"]]
    if d.get("split"):
        lines += ["", "Where a decode step goes, ms per token (`laneplay.bench.split`):", "",
                  "| engine | context | step | weight products | attention | other |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['engine']} | {r['context']} | {r['step_ms']:.2f} | {r['matrices_ms']:.2f} | "
                  f"{r['attention_ms']:.2f} | {r['other_ms']:.2f} |" for r in d["split"]]
    return "\n".join(lines)


def quality_tables(d: dict) -> str:
    """bench/lowbit_quality.py's run: the low-bit paths against float32 on the default model."""
    lines = [f"Low-bit quality vs float32, default model, {(d.get('when') or '')[:10]}; teacher-forced over "
             f"{d.get('corpus', 'a code corpus')}:", "",
             "| dtype | positions | top-1 agreement | max abs Δlogit | mean abs Δlogit |", "|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['positions']} | {r['top1_agreement']:.2%} | {r['max_abs_dlogit']:.3f} | "
              f"{r['mean_abs_dlogit']:.4f} |" for r in d.get("agreement") or []]
    if d.get("humaneval"):
        lines += ["", f"Greedy HumanEval pass@1 ({d.get('problems')}, instruct mode, checked in the sandbox):", "",
                  "| dtype | problems | greedy pass@1 |", "|---|---|---|"]
        lines += [f"| {r['dtype']} | {r['problems']} | {r['greedy_pass1']:.3f} |" for r in d["humaneval"]]
    return "\n".join(lines)


def dtp_table(d: dict) -> str:
    lines = [f"DTP A/B, {_head(d)}: {d.get('note', '')}", "",
             "| mode | ranks | ms/token | tok/s | delayed-wait ms/token | wait-now ms/token |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['world']} | {_f(r.get('ms_per_token'), '.1f')} | {_f(r.get('decode_tps'), '.1f')} | "
              f"{_f(r.get('wait_ms'), '.2f')} | {_f(r.get('exposed_ms'), '.2f')} |" for r in d.get("rows") or []]
    return "\n".join(lines)


def batching_tables(d: dict) -> str:
    """bench/batching.py's run: what a shared step costs, concurrent users, a long prompt joining, a
    Playground request beside pass@N, a reused prefix."""
    lines = [f"Many users on one engine ({d.get('dtype')}), {_head(d)}. One decode step for k separate "
             "requests, each on its own cache at its own position:", "",
             "| requests | ms/step | × one | ms/row |", "|---|---|---|---|"]
    lines += [f"| {r['requests']} | {r['ms_per_step']:.1f} | {r['vs_one']:.2f} | {r['ms_per_row']:.2f} |"
              for r in d.get("step_costs") or []]
    lines += ["", f"k clients at once, {d.get('tokens')} greedy tokens each; TTFT from send:", "", *_users_table(d)]
    same = d.get("copies")
    if same:
        lines += ["", f"The same request from {same[0]['users']} clients at once ({d.get('tokens')} greedy tokens each), "
                  "against it alone (`auto` speculation; the share of drafts it keeps alone):", "",
                  "| prompt | drafts kept alone | TTFT alone ms | last TTFT of the copies ms | alone s | copies s | × alone |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['prompt']} | {_f(r.get('acceptance'), '.2f')} | {r['alone_ttft_ms']:.0f} | {r['ttft_max_ms']:.0f} | "
                  f"{r['alone_s']:.2f} | {r['wall_s']:.2f} | {r['wall_vs_alone']:.2f} |" for r in same]
    j = d.get("long_prompt_joins")
    if j:
        lines += ["", f"Three requests decoding while a {j['prompt_tokens']}-token prompt joins: their time between "
                  f"tokens p50 {j['tbt_p50_ms']:.1f} ms, p99 {j['tbt_p99_ms']:.0f} ms, against 2 × their ms/token alone "
                  f"({j['alone_ms_per_token']:.1f}) + one chunk ({j['chunk_ms']:.0f} ms) = {j['bound_ms']:.0f} ms; the "
                  f"long prompt's TTFT {j['joiner_ttft_ms']:.0f} ms."]
    b = d.get("beside_passn")
    if b:
        many = b.get("requests", 1)
        lines += ["", (f"{many} Playground requests (128 tokens each, one after another)" if many > 1 else
                       "A Playground request (128 tokens)") + f" while a pass@N-like run ({b.get('problems', 8)} "
                  f"problems, N = {b.get('n', 8)}, batch priority) works: TTFT {b['busy_ttft_ms']:.0f} ms "
                  + ("(median; " + _f(b.get("busy_ttft_max_ms"), ".0f") + " at most) " if many > 1 else "")
                  + f"against {b['idle_ttft_ms']:.0f} idle ({b['ttft_vs_idle']:.2f} × idle), "
                  f"{b['busy_tps']:.1f} tok/s ({b['tps_vs_idle']:.2f} × idle)."]
    p = d.get("prefix_reuse")
    if p:
        lines += ["", f"The same code with a new instruction ({p['prompt_tokens']}-token prompt): {p['cached_tokens']} "
                  f"prompt tokens reused (whole {p['prefill_chunk']}-token chunks), TTFT {p['warm_ttft_ms']:.0f} ms "
                  f"against {p['cold_ttft_ms']:.0f} ms cold ({p['warm_vs_cold']:.2f})."]
    return "\n".join(lines)


def _users_table(d: dict) -> list[str]:
    return ["| engine | users | TTFT min ms | median | max | wall s | wall × alone | × its slowest alone | "
            "mean done s | mean × alone | worst × its own alone | rows/step |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"] + [
        f"| {r['engine']} | {r['users']} | {r['ttft_min_ms']:.0f} | {r['ttft_median_ms']:.0f} | "
        f"{r['ttft_max_ms']:.0f} | {r['wall_s']:.2f} | {r['wall_vs_alone']:.2f} | "
        f"{_f(r.get('wall_vs_slowest_alone'), '.2f')} | {_f(r.get('mean_done_s'), '.2f')} | "
        f"{_f(r.get('mean_done_vs_alone'), '.2f')} | {_f(r.get('worst_vs_own_alone'), '.2f')} | "
        f"{r['rows_per_step']:.1f} |"
        for r in d.get("users") or []]


def batching_dtp_table(d: dict) -> str:
    """bench/batching.py's DTP table: k clients at once on DTP ranks, one at a time and batched by the ranks."""
    return "\n".join([f"k clients at once on {d.get('world_size')} DTP ranks ({d.get('dtype')}; gloo on the CPU, "
                      f"the ranks sharing the cores), {d.get('tokens')} greedy tokens each, {_head(d)}:", "",
                      *_users_table(d)])


def serving_table(d: dict) -> str:
    """bench/serving.py's run: open-loop arrivals, ours vs llama-server."""
    lines = [f"Open-loop arrivals, {d.get('requests')} requests per load (prompts 50-2,000 tokens, 64-512 greedy "
             f"tokens, {d.get('threads')} threads), {_head(d)}; load = average requests in flight at their "
             f"alone speed ({d.get('mean_alone_s', 0):.2f} s each):", "",
             "| server | load | TTFT p50 ms | TTFT p99 ms | TBT p50 ms | TBT p99 ms | tok/s per user | tok/s in all |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['server']} | {r['load']:.0f} | {_f(r.get('ttft_p50_ms'), '.0f')} | {_f(r.get('ttft_p99_ms'), '.0f')} | "
              f"{_f(r.get('tbt_p50_ms'), '.1f')} | {_f(r.get('tbt_p99_ms'), '.1f')} | "
              f"{_f(r.get('user_tps_median'), '.1f')} | {_f(r.get('aggregate_tps'), '.1f')} |" for r in d.get("rows") or []]
    return "\n".join(lines)


def gpu_tables(d: dict) -> str:
    """bench/gpu_check.py's run: the kernels' check and each model's decode paths."""
    bw = d.get("bandwidth") or {}
    lines = [f"`bench/gpu_check.py`, {(d.get('when') or '')[:10]}, {d.get('gpu')}, torch {d.get('torch')}, "
             f"Triton {d.get('triton')}; measured copy bandwidth {_f(bw.get('copy_GBps'), '.0f')} GB/s (read + write), "
             f"read bandwidth {_f(bw.get('read_GBps'), '.0f')} GB/s.", "",
             "| kernel | cases within tolerance | worst rel. error fp32 | fp16 | bf16 |", "|---|---|---|---|---|"]
    ks = d.get("kernels") or []
    for k in sorted({r["kernel"] for r in ks}):
        rs = [r for r in ks if r["kernel"] == k]
        worst = [max((r["rel_err"] for r in rs if r["dtype"] == t), default=None) for t in ("float32", "float16", "bfloat16")]
        lines.append(f"| {k} | {sum(r['ok'] for r in rs)}/{len(rs)} | " + " | ".join(_f(w, ".1e") for w in worst) + " |")
    for m in d.get("models") or []:
        if "variants" not in m:
            continue
        lines += ["", f"{m['model']}, batch 1, {m['dtype']}, {m['prompt_tokens']}-token prompt then "
                  f"{m['decode_steps']} steps; {m['bytes_per_token'] / 1e9:.3f} GB read per token.", "",
                  "| decode path | ms/token | tokens/s | GB/s | share of read bandwidth |", "|---|---|---|---|---|"]
        lines += [f"| {label} | {v['ms_per_token']:.3f} | {v['tokens_per_s']:.0f} | {v['GBps']:.0f} | "
                  f"{v['share_of_read_bw']:.0%} |" for label, v in m["variants"].items()]
        p = m.get("parity_vs_decode")
        if p:
            lines += ["", f"Graph step vs `LaneModel.decode` over {p['steps']} greedy steps: max relative |Δlogit| "
                      f"{p['max_rel_dlogit']:.1e}, top-1 agreement {p['greedy_top1_agreement']:.0%}."]
    return "\n".join(lines)


def spec_table(d: dict) -> str:
    """bench/spec.py's run: prompt-lookup speculation on code edits and plain completions."""
    runs = d.get("repeat", 1)
    each = f" (each mode's fastest of {runs} interleaved runs a prompt)" if runs > 1 else ""
    lines = [f"Speculative decoding by prompt lookup ({d.get('model')}, {d.get('dtype')}, greedy), speculation off "
             f"vs auto in one run{each}, {_head(d)}; x = the median of each prompt's decode tokens/s ratio:", "",
             "| set | prompts | off tok/s | auto tok/s | median x | min x | acceptance | tokens/step | same tokens "
             "| replay x | hindsight x |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, label in (("edits", "edits (HumanEval)"), ("plain", "plain completions")):
        r = d.get(name)
        if r:
            lines.append(f"| {label} | {r['prompts']} | {_f(r.get('median_off_tps'), '.1f')} | "
                         f"{_f(r.get('median_on_tps'), '.1f')} | {_f(r.get('median_speedup'), '.2f')} | "
                         f"{_f(r.get('min_speedup'), '.2f')} | {_f(r.get('acceptance'), '.2f')} | "
                         f"{_f(r.get('tokens_per_step'), '.2f')} | {r['same_tokens']}/{r['prompts']} | "
                         f"{_f(r.get('median_replay'), '.2f')} | {_f(r.get('median_hindsight'), '.2f')} |")
    if d.get("verify_costs_ms"):
        c = d["verify_costs_ms"]
        lines += ["", "replay x: `auto`'s own rule on the same greedy tokens; hindsight x: the best any prompt-lookup "
                  "policy could do on them (verifying exactly the drafts that will be kept); both priced with the "
                  "verify costs measured in the run: "
                  + ", ".join(f"{S} rows {x / c[0]:.2f}×" for S, x in enumerate(c, 1) if S in (2, 3, 4, 8, 9, len(c)))
                  + " a decode step."]
    return "\n".join(lines)


def report(folder: Path = RESULTS) -> str:
    parts = []
    for name, render in (("decode-cpu.json", decode_tables), ("lowbit-quality.json", quality_tables),
                         ("dtp-cpu.json", dtp_table), ("batching.json", batching_tables),
                         ("batching-dtp.json", batching_dtp_table),
                         ("serving.json", serving_table), ("spec.json", spec_table), ("gpu-check.json", gpu_tables)):
        path = Path(folder) / name
        if path.is_file():
            parts.append(render(json.loads(path.read_text())))
    return "\n\n".join(parts) or "No results yet: run `make bench`."


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=str(RESULTS))
    print(report(Path(p.parse_args(argv).results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
