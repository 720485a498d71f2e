"""`laneplay perfmodel`: the batch-1 decode performance model (laneplay/perfmodel.py) as tables and JSON.

    laneplay perfmodel [--node 8xH200,8xMI300X] [--config path/to/config.json] [--position 1024]
                       [--gpus N] [--hbm-gbps X] [--bw-efficiency F] [--collective-us X] ... [--json] [--no-write]

Prints, per node, every parameter with where its value comes from (calibrated from a run in
bench/results/, or assumed), the predicted ms/token of standard TP and of DTP, and for Kog's published
nodes what single parameter would reach their number. Writes bench/results/perfmodel.json unless
--no-write.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace

from laneplay.perfmodel import (
    DTYPE_BYTES,
    KOG_TPS,
    PRESETS,
    Node,
    PerfModelError,
    implied,
    node_preset,
    param_count,
    predict,
    resolve_config,
)


# ---- command line -------------------------------------------------------------------------------------

def _positive(kind, what: str, allow_zero: bool = False):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a number, got {text!r}") from None
        if not (v >= 0 if allow_zero else v > 0) or (isinstance(v, float) and math.isnan(v)):
            raise argparse.ArgumentTypeError(f"{what} must be {'>= 0' if allow_zero else '> 0'}, got {text!r}")
        return v
    return parse


def _fraction(text: str) -> float:
    v = _positive(float, "--bw-efficiency")(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"--bw-efficiency is a fraction in (0, 1], got {text!r}")
    return v


def _dtype(text: str) -> int:
    if text.lower() in DTYPE_BYTES:
        return DTYPE_BYTES[text.lower()]
    if text in ("1", "2", "4"):
        return int(text)
    raise argparse.ArgumentTypeError(f"--dtype must be one of {', '.join(DTYPE_BYTES)} or 1, 2, 4 bytes, got {text!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node", default="8xH200,8xMI300X",
                   help=f"comma-separated presets: {', '.join(PRESETS)} (default: 8xH200,8xMI300X)")
    p.add_argument("--config", default=None, help="a config.json (or checkpoint directory); default: Laneformer 2B")
    p.add_argument("--position", type=_positive(int, "--position", True), default=1024,
                   help="context position of the decoded token (KV cache read); default 1024")
    p.add_argument("--broadcast-delay", type=_positive(int, "--broadcast-delay", True), default=None,
                   help="override the config's broadcast_delay")
    g = p.add_argument_group("node parameters (override the preset)")
    g.add_argument("--gpus", type=_positive(int, "--gpus"), help="devices (= world size)")
    g.add_argument("--hbm-gbps", type=_positive(float, "--hbm-gbps"), help="memory bandwidth per device, GB/s")
    g.add_argument("--bw-efficiency", type=_fraction, help="achievable fraction of it, (0, 1]")
    g.add_argument("--collective-us", type=_positive(float, "--collective-us", True),
                   help="latency per collective, µs")
    g.add_argument("--collective-gbps", type=_positive(float, "--collective-gbps"),
                   help="collective bus bandwidth, GB/s ('inf': no bandwidth term)")
    g.add_argument("--comm-streams", type=_positive(int, "--comm-streams", True),
                   help="collectives in flight at once (0 = unlimited; default 1)")
    g.add_argument("--launch-us", type=_positive(float, "--launch-us", True),
                   help="overhead per kernel, µs (for the chosen graph/eager mode)")
    g.add_argument("--kernels-per-layer", type=_positive(float, "--kernels-per-layer", True))
    g.add_argument("--tail-kernels", type=_positive(float, "--tail-kernels", True))
    g.add_argument("--dtype", type=_dtype, default=None, help="fp16, bf16, fp32, fp8 (or bytes: 1, 2, 4)")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--eager", dest="cuda_graph", action="store_false", default=None,
                      help="kernels launched one by one (no CUDA/HIP graph)")
    mode.add_argument("--cuda-graph", dest="cuda_graph", action="store_true", help="one graph per step (default)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the tables")
    p.add_argument("--no-write", action="store_true", help="do not write bench/results/perfmodel.json")


def _node_from_args(name: str, args) -> Node:
    eager = args.cuda_graph is False
    launch = None if args.launch_us is None else {("launch_eager_us" if eager else "launch_graph_us"): args.launch_us}
    return node_preset(
        name, gpus=args.gpus, hbm_gbps=args.hbm_gbps, bw_efficiency=args.bw_efficiency,
        collective_us=args.collective_us, collective_gbps=args.collective_gbps, comm_streams=args.comm_streams,
        kernels_per_layer=args.kernels_per_layer, tail_kernels=args.tail_kernels, dtype_bytes=args.dtype,
        cuda_graph=args.cuda_graph, **(launch or {}))


def _tps(v: float) -> str:
    return format(v, ",.0f") if v >= 100 else format(v, ".3g")


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _assumptions(node: Node) -> list[str]:
    shown = ["gpus", "hbm_gbps", "bw_efficiency", "collective_us", "collective_gbps", "comm_streams",
             "launch_graph_us", "launch_eager_us", "cuda_graph", "kernels_per_layer", "tail_kernels", "dtype_bytes"]
    lines = []
    for k in shown:
        src = node.sources.get(k) or {"comm_streams": "assumed: collectives run one at a time on one stream",
                                      "cuda_graph": "assumed: the whole step replayed as one graph"}.get(k, "assumed")
        v = getattr(node, k)
        lines.append(f"  {k:<18} {format(v, '.4g') if isinstance(v, float) else str(v):<10} {src}")
    if node.shared_bandwidth:
        lines.append(f"  {'shared_bandwidth':<18} {'True':<10} ranks share one memory bus: "
                     "per-rank bandwidth = hbm_gbps / gpus")
    if "calibration" in node.sources:
        lines.append(f"  ({node.sources['calibration']})")
    return lines


def report(cfg, nodes: list[Node], position: int) -> dict:
    entries = []
    for node in nodes:
        p = predict(cfg, node, position)
        e = {"node": asdict(node), "prediction": p.as_dict()}
        if node.name in KOG_TPS and node.gpus == 8:
            kog = KOG_TPS[node.name]
            e["kog"] = {"tokens_per_s": kog, "ratio_to_dtp": kog / p.tokens_per_s_dtp,
                        "ratio_to_tp": kog / p.tokens_per_s_tp, "implied": implied(cfg, node, position, kog)}
        entries.append(e)
    return _finite({"model": cfg.name or cfg.arch, "config": cfg.to_dict(), "param_count": param_count(cfg),
                    "position": position, "nodes": entries})


def _finite(v):
    """JSON-safe copy: infinities (e.g. collective_gbps = inf, no bandwidth term) become None."""
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return None if isinstance(v, float) and math.isinf(v) else v


def _print_report(rep: dict, cfg) -> None:
    d = cfg.broadcast_delay
    print(f"Batch-1 decode model: {rep['model']} ({rep['param_count'] / 1e9:.3f} B parameters, "
          f"{cfg.num_layers} layers, "
          f"{cfg.num_lanes} lanes, broadcast_delay {d}, {len(cfg.swa_layers)} sliding-window layers of "
          f"{cfg.sliding_window}), token at context position {rep['position']}.")
    print("time/token = bytes/(HBM x efficiency) + kernels x launch + exposed collectives; TP: 2 blocking "
          "all-reduces per layer + argmax gather; DTP: the engine's schedule (issue at layer i, wait at i + d).\n")
    rows = []
    for e in rep["nodes"]:
        node = Node(**{k: (math.inf if k == "collective_gbps" and v is None else v) for k, v in e["node"].items()})
        print(f"Assumptions for {node.name}:")
        print("\n".join(_assumptions(node)))
        p = e["prediction"]
        print(f"  -> per device {p['bytes_per_device'] / 1e6:.1f} MB/token "
              f"(KV {p['kv_bytes_per_device'] / 1e6:.1f} MB), "
              f"all devices {p['bytes_per_token'] / 1e9:.3f} GB; memory {p['memory_ms'] * 1e3:.0f} µs + "
              f"launch {p['launch_ms'] * 1e3:.0f} µs; collectives TP {p['collectives_tp']} blocking, DTP "
              f"{p['collectives_dtp_blocking']} blocking + {p['collectives_dtp_delayed']} delayed\n")
        for mode in ("tp", "dtp"):
            comm = p[f"comm_ms_{mode}"]
            rows.append({"node": node.name, "mode": "standard TP" if mode == "tp" else f"DTP (d={d})",
                         "ms": p[f"ms_per_token_{mode}"], "tps": _tps(p[f"tokens_per_s_{mode}"]),
                         "exposed": p[f"exposed_comm_ms_{mode}"] * 1e3,
                         "hidden": max(0.0, 1 - p[f"exposed_comm_ms_{mode}"] / comm) if comm > 0 else None})
    from laneplay.bench.common import print_table  # it loads torch: imported only to print a report

    print_table(rows, [("node", "node", "s"), ("mode", "schedule", "s"), ("ms", "ms/token", ".3f"),
                       ("tps", "tokens/s", "s"), ("exposed", "exposed comm µs/token", ".1f"),
                       ("hidden", "comm hidden", ".0%")])
    for e in rep["nodes"]:
        k = e.get("kog")
        if not k:
            continue
        imp = k["implied"]
        print(f"\nKog on {e['node']['name']}: {k['tokens_per_s']:,.0f} tokens/s = {k['ratio_to_dtp']:.2f}x our DTP "
              f"prediction ({k['ratio_to_tp']:.2f}x standard TP). To reach it with the other parameters as assumed:")
        for mode, label in (("dtp", "DTP"), ("tp", "standard TP")):
            m = imp[mode]
            print(f"  {label:<11} collective latency {_fmt(m['collective_us'], '.1f', 'none suffices (even 0)')}"
                  f"{' µs' if m['collective_us'] is not None else ''}, or bandwidth efficiency "
                  f"{_fmt(m['bw_efficiency'], '.0%', '> 100%')}, or launch overhead "
                  f"{_fmt(m['launch_us'], '.2f', 'none suffices (even 0)')}"
                  f"{' µs/kernel' if m['launch_us'] is not None else ''}")


def run(args) -> int:
    try:
        cfg = resolve_config(args.config)
        if args.broadcast_delay is not None:
            cfg = replace(cfg, broadcast_delay=args.broadcast_delay)
        names = [n.strip() for n in args.node.split(",") if n.strip()]
        if not names:
            raise PerfModelError("--node names no preset")
        nodes = [_node_from_args(n, args) for n in names]
        rep = report(cfg, nodes, args.position)
    except ValueError as e:  # PerfModelError, ConfigError
        print(f"laneplay perfmodel: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rep, indent=2, default=str))
    else:
        _print_report(rep, cfg)
    if not args.no_write:
        from laneplay.bench.common import write_json

        path = write_json("perfmodel", rep)
        if not args.json:
            print(f"\nwrote bench/results/{path.name}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="laneplay perfmodel", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
