"""`laneplay generate`: one prompt -> stdout, then a line with TTFT, tokens/s and device."""
from __future__ import annotations

import argparse
import sys

from laneplay.engine.checkpoint import DEFAULT_MODEL
from laneplay.engine.runtime import DTYPE_CHOICES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint dir, .gguf, Hub id in the local cache, or the embedded default")
    p.add_argument("--prompt", help="the prompt (default: read stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--n", type=int, default=1, help="number of samples (printed one after another)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="weights: auto (int4 on the CPU, float32 on CUDA), float32, bfloat16, float16, int8, int4")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--no-compile", action="store_true", help="run the decode step eagerly (default: compiled on CPU at world size 1)")
    p.add_argument("--speculative", default="auto", choices=("auto", "off", "lookup"),
                   help="prompt-lookup speculative decoding: auto (where it pays), lookup (always draft), off")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="CUDA: decode through LaneModel.decode instead of the static step captured as CUDA graphs")


def run(args) -> int:
    from laneplay.engine import SamplingParams, load_engine

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop, n=args.n)
    try:
        params.validate()
        eng = load_engine(args.model, device=args.device, dtype=args.dtype, world_size=args.world_size,
                          compile=False if args.no_compile else "auto",
                          graphs=False if args.no_cuda_graphs else "auto")
    except (ValueError, OSError) as e:
        print(f"laneplay generate: {e}", file=sys.stderr)
        return 2
    try:
        try:
            events = eng.generate(prompt, params, chat=args.chat, speculative=args.speculative)
        except ValueError as e:
            print(f"laneplay generate: {e}", file=sys.stderr)
            return 2
        texts: dict[int, list[str]] = {i: [] for i in range(params.n)}
        final = {}
        for ev in events:
            if params.n == 1:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            else:
                texts[ev.sample_index].append(ev.text)
            if ev.finish_reason:
                final[ev.sample_index] = ev.metrics
        for i in range(params.n if params.n > 1 else 0):
            print(f"--- sample {i} (seed {final[i].seed}) ---\n{''.join(texts[i])}")
        m = final[0]
        tps = f"{m.decode_tokens_per_second:.1f}" if m.decode_tokens_per_second else "n/a"
        spec = (f"speculative lookup: {m.accepted_tokens}/{m.draft_tokens} drafts accepted, "
                f"{m.completion_tokens} tokens in {m.decode_steps + 1} steps" if m.speculative == "lookup"
                else f"speculative off ({m.speculative_reason})")
        print(f"\n[ttft {m.ttft_ms:.0f} ms | decode {tps} tokens/s | {m.completion_tokens} tokens | "
              f"prompt {m.prompt_tokens} | finish {m.finish_reason} | {m.device} x{m.world_size} | {spec}]")
        return 0
    finally:
        eng.close()
