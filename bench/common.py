"""Shared benchmark helpers: machine bandwidth, medians, quiet-machine check, table + JSON output."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def measure_bandwidth(gib: float = 1.0, reps: int = 10) -> dict:
    """DRAM bandwidth of this machine now: 1 GiB read (sum) and copy (read + write counted), GB/s."""
    n = int(gib * 2**30 / 4)
    src, dst = torch.randn(n), torch.empty(n)
    for _ in range(2):
        dst.copy_(src)
        src.sum()
    copy, read = [], []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        copy.append(time.perf_counter() - t)
        t = time.perf_counter()
        src.sum()
        read.append(time.perf_counter() - t)
    nbytes = n * 4
    return {"read_gbps": nbytes / median(read) / 1e9, "copy_gbps": 2 * nbytes / median(copy) / 1e9}


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "load_average_1m": load_average(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format)."""
    cells = [[h for _, h, _ in columns]] + [
        [("-" if r.get(k) is None else format(r[k], f)) for k, _, f in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    for j, row in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path
