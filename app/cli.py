"""`laneplay serve`: the web playground on 127.0.0.1:7860, with a local engine it starts and supervises,
or a running OpenAI-compatible engine (`--engine-url`)."""
from __future__ import annotations

import argparse
import logging
import os
import sys

DEFAULT_MODEL = "smollm2-135m-instruct"


def world_size(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of ranks or auto, got {text!r}") from None
    if not 1 <= n <= 8:
        raise argparse.ArgumentTypeError(f"the world size must be 1 to 8 or auto, got {n}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--engine-url", default=None,
                   help="use a running OpenAI-compatible engine (ours on a GPU node, vLLM, llama.cpp's server, ...) "
                        "instead of starting one here")
    p.add_argument("--api-key", default=None, help="the engine's API key (default: $LANEPLAY_API_KEY)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="local engine: checkpoint dir, .gguf, Hub id in the local cache, or the embedded default")
    p.add_argument("--device", default="cpu", help="local engine: cpu or cuda")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16", "int8", "int4"),
                   help="local engine weights: auto (int4 on the CPU, float32 on CUDA), float32, bfloat16, float16, int8, int4")
    p.add_argument("--world-size", type=world_size, default=1,
                   help="local engine: DTP ranks; it must divide the model (a Llama model's attention and key-value "
                        "heads, a Laneformer's lanes), or auto: the smallest size above 1 that does")
    p.add_argument("--no-compile", action="store_true", help="local engine: run the decode step eagerly")
    p.add_argument("--db", default=None, help="database URL (default: $LANEPLAY_DATABASE_URL, else "
                                              "$LANEPLAY_DATA_DIR/laneplay.db, data dir ./data)")
    p.add_argument("--forwarded-allow-ips", default=None,
                   help="behind a reverse proxy: the proxy addresses whose X-Forwarded-For/-Proto are believed "
                        "(the client address for limits, https for Secure cookies); default 127.0.0.1, "
                        "or $FORWARDED_ALLOW_IPS")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def run(args) -> int:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from laneplay.app.context import AppContext
    from laneplay.app.supervisor import LocalEngine, RemoteEngine
    from laneplay.app.web import create_app
    from laneplay.storage import Store

    if not 0 < args.port < 65536:
        print("laneplay serve: --port must be in 1..65535", file=sys.stderr)
        return 2
    try:
        store = Store(args.db)
    except Exception as e:  # a bad URL or an unwritable directory: say so and stop
        print(f"laneplay serve: cannot open the database: {e}", file=sys.stderr)
        return 2
    if args.engine_url:
        engine = RemoteEngine(args.engine_url, api_key=args.api_key or os.environ.get("LANEPLAY_API_KEY") or None)
    else:
        engine = LocalEngine(args.model, device=args.device, dtype=args.dtype, world_size=args.world_size,
                             compile=not args.no_compile)
    app = create_app(AppContext(engine=engine, store=store))
    engine.start()  # after the UI is built: the page answers sooner when the two do not compete
    where = args.engine_url or f"a local engine ({args.model}, {args.device} x{args.world_size})"
    print(f"Laneplay on http://{args.host}:{args.port} — engine: {where}", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, proxy_headers=True,
                    forwarded_allow_ips=args.forwarded_allow_ips)
    finally:
        engine.stop()
        store.close()
    return 0
