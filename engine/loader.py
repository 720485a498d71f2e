"""`load_engine`: resolve the checkpoint, decide the runtime once, build the runner, wrap it in the front end.

Imports go one way: loader -> (engine front end, local runner, DTP runner) -> model; nothing imports
the loader back.
"""
from __future__ import annotations

import os
from pathlib import Path

from laneplay.engine.checkpoint import GGUFSource, load_weights, open_checkpoint, resolve_checkpoint
from laneplay.engine.engine import Engine
from laneplay.engine.model import LaneModel
from laneplay.engine.runner import LocalRunner
from laneplay.engine.runtime import PREFILL_CHUNK, make_runtime
from laneplay.protocol import STAGE_COMPILING, STAGE_LOADING

DTP_OPTIONS = ("wait_now", "timeline", "timeout_s")


def load_engine(model: str | os.PathLike = "smollm2-135m-instruct", device: str | None = "cpu",
                dtype="float32", world_size: int = 1, compile=False, threads: int | None = None,
                kv_budget_gb: float | None = None, prefill_chunk: int = PREFILL_CHUNK, progress=None,
                graphs="auto", **options) -> Engine:
    """Load a checkpoint (HF directory, .gguf, Hub id in the local cache, or the embedded default).

    dtype: float32, bfloat16, float16, or on the CPU the low-bit weight paths int4 / int8 (projections
    packed, float32 everywhere else; `kernels.lowbit`), or "auto" (int4 on the CPU, float32 elsewhere).

    graphs: "auto" (the static CUDA-graph decode step on CUDA at world size 1), True or False.
    compile: False (eager, the library default), True, or "auto" (what the command-line tools use:
    compiled on CPU at world size 1). kv_budget_gb: the most KV cache one request may reserve
    (default: a fifth of RAM on CPU, 40% of the GPU on CUDA); a request past it is refused up front.
    progress: called with "loading" and "compiling" as loading goes on (the app shows it). world_size > 1 runs the model's lanes on that many rank processes (DTP); its options are
    `wait_now` (expose the collectives: the A/B of the delay), `timeline` (record every rank's per-step spans)
    and `timeout_s` (a silent rank is a failure after this long).
    """
    unknown = [k for k in options if k not in DTP_OPTIONS]
    if unknown:
        raise TypeError(f"unknown load_engine option(s): {', '.join(unknown)}")
    if options and world_size == 1:
        raise TypeError(f"{', '.join(options)} only apply with world_size > 1")
    runtime = make_runtime(device, dtype, world_size, compile, threads, kv_budget_gb, prefill_chunk, graphs)
    progress = progress or (lambda stage: None)
    path = resolve_checkpoint(model)
    progress(STAGE_LOADING)
    cfg, src = open_checkpoint(path)
    try:
        tokenizer = checkpoint_tokenizer(path, src)
        if world_size > 1:
            from laneplay.engine.dtp import lanes_config

            cfg = lanes_config(cfg, world_size)  # fail on a bad split before starting any rank
        else:
            weights = load_weights(cfg, src, dtype=runtime.torch_dtype, device=runtime.torch_device)
            if runtime.weight_format:
                from laneplay.kernels.lowbit import pack_weights

                weights = pack_weights(weights, runtime.weight_format)
    finally:
        src.close()
    if world_size > 1:
        from laneplay.engine.dtp import DTPRunner

        runner = DTPRunner(path, runtime, **options)
    else:
        if runtime.compile:
            progress(STAGE_COMPILING)
        runner = LocalRunner(LaneModel(cfg, weights), runtime)
    return Engine(cfg, runner, runtime, path, tokenizer=tokenizer)


def reload(engine: Engine, model: str | os.PathLike) -> Engine:
    """Another checkpoint in an engine's running DTP ranks (no restart); the old front end is spent."""
    from laneplay.engine.dtp import DTPRunner, lanes_config

    if not isinstance(engine.runner, DTPRunner):
        raise TypeError("reload() keeps DTP ranks running; load a single-process engine with load_engine()")
    path = resolve_checkpoint(model)
    cfg, src = open_checkpoint(path)
    try:
        cfg = lanes_config(cfg, engine.world_size)
        tokenizer = checkpoint_tokenizer(path, src)
    finally:
        src.close()
    engine.runner.load(path)
    return Engine(cfg, engine.runner, engine.runtime, path, tokenizer=tokenizer)


def checkpoint_tokenizer(path: Path, src):
    """The checkpoint's tokenizer (GGUF: from the already parsed file), or the error saying why not."""
    from laneplay.engine.tokenizer import load_tokenizer, tokenizer_from_gguf

    try:
        return tokenizer_from_gguf(src.reader) if isinstance(src, GGUFSource) else load_tokenizer(path)
    except FileNotFoundError as e:
        return e  # raised when text is first needed; logits() works without a tokenizer
