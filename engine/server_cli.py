"""`laneplay engine`: the engine HTTP server only (OpenAI-compatible API) on 127.0.0.1:8000 by default."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from laneplay.engine.checkpoint import DEFAULT_MODEL
from laneplay.engine.runtime import DTYPE_CHOICES, PREFILL_CHUNK
from laneplay.processes import in_own_thread
from laneplay.protocol import STAGE_WARMING_UP, stage_line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="checkpoint dir, .gguf, Hub id in the local cache, or the embedded default")
    p.add_argument("--served-model-name",
                   help="the model id clients see (default: --model, or the checkpoint's own name for a path)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="weights: auto (int4 on the CPU, float32 on CUDA), float32, bfloat16, float16, int8, int4")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $LANEPLAY_API_KEY)")
    p.add_argument("--max-queue", type=int, default=32, help="requests waiting beyond this get 429")
    p.add_argument("--max-rows", type=int, default=16,
                   help="rows (samples of all running requests) per shared decode step; 1 runs requests one at a "
                        "time (DTP and the CUDA static step always do)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may generate before it ends with finish_reason 'length'")
    p.add_argument("--kv-budget-gb", type=float, default=None,
                   help="the most KV cache the running requests may reserve together, in GiB; a request "
                        "waits until its cache fits, and one larger than the budget gets a 400 (default: a fifth of RAM on CPU, 40%% of the GPU on CUDA)")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                   help="prompt tokens per prefill step: how long a joining prompt holds the running requests' "
                        "next token, and the grain at which a repeated prompt's prefix is reused")
    p.add_argument("--no-compile", action="store_true", help="run the decode step eagerly (default: compiled on CPU at world size 1)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="CUDA: decode through LaneModel.decode instead of the static step captured as CUDA graphs")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args) -> int:
    from laneplay.engine import SamplingParams, load_engine
    from laneplay.engine.server import create_app, serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("laneplay.engine")
    api_key = args.api_key or os.environ.get("LANEPLAY_API_KEY") or None
    if args.max_queue < 0 or args.request_timeout <= 0 or not 1 <= args.max_rows <= 16:
        print("laneplay engine: --max-queue must be >= 0, --request-timeout > 0 and --max-rows in [1, 16]",
              file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("listening on %s without an API key: anyone who can reach it can use the engine", args.host)
    def stage(name: str) -> None:  # one line per stage on stderr: `laneplay serve` shows them
        print(stage_line(name), file=sys.stderr, flush=True)

    def load():
        return load_engine(args.model, device=args.device, dtype=args.dtype, world_size=args.world_size,
                           compile=False if args.no_compile else "auto",
                           graphs=False if args.no_cuda_graphs else "auto", kv_budget_gb=args.kv_budget_gb,
                           prefill_chunk=args.prefill_chunk, progress=stage)

    def warm_up(eng):  # one tiny request first, so the first client does not pay for lazy initialisation
        stage(STAGE_WARMING_UP)
        for _ in eng.generate("Hello", SamplingParams(max_tokens=2, temperature=0.0)):
            pass

    # In one process, loading and the warm-up run in a thread that ends, so that the scheduler's worker is
    # the one thread whose parallel torch ops keep an OpenMP pool (`processes.in_own_thread`). DTP ranks
    # are child processes that die with the thread that started them: those load here.
    own = in_own_thread if args.world_size == 1 else (lambda fn, *a: fn(*a))
    try:
        eng = own(load)
    except (ValueError, OSError) as e:
        print(f"laneplay engine: {e}", file=sys.stderr)
        return 2
    app = None
    try:
        own(warm_up, eng)
        name = args.served_model_name or (None if Path(args.model).expanduser().exists() else args.model)
        app = create_app(eng, api_key=api_key, max_queue=args.max_queue, request_timeout_s=args.request_timeout,
                         max_rows=args.max_rows, model_name=name)
        log.info("serving %s on http://%s:%d (%s x%d)", name or eng.model_name, args.host, args.port,
                 args.device, args.world_size)
        serve(app, host=args.host, port=args.port, log_level=args.log_level)
        return 0
    finally:
        if app is not None:
            app.state.scheduler.close()  # the worker must be out of the engine before it closes
        eng.close()
