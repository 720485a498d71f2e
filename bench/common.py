"""Shared benchmark helpers: machine bandwidth, medians, quiet-machine check, table + JSON output."""
from __future__ import annotations

import contextlib
import copy
import json
import os
import platform
import resource
import statistics
import sys
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


QUIET_MAX_OTHER_CORES = 0.25  # busy cores of other processes above which 2-thread numbers are not trusted


def _busy_jiffies() -> int:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return sum(v) - v[3] - v[4]  # everything but idle and iowait


def _own_cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


QUIET_WINDOW_S = 1.5  # how long check_quiet watches the other processes (`laneplay bench --quick`: 0.3 s)


def other_busy_cores(seconds: float | None = None) -> float | None:
    """How many cores other processes kept busy over `seconds` (default QUIET_WINDOW_S; this process and
    its children excluded); None where /proc/stat is unavailable."""
    seconds = QUIET_WINDOW_S if seconds is None else seconds
    try:
        b0, m0, t0 = _busy_jiffies(), _own_cpu_s(), time.monotonic()
        time.sleep(seconds)
        b1, m1, t1 = _busy_jiffies(), _own_cpu_s(), time.monotonic()
    except OSError:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return max(0.0, ((b1 - b0) / hz - (m1 - m0)) / (t1 - t0))


def check_quiet(allow_noisy: bool, when: str = "before") -> dict:
    """Refuses (exit status 3) when other processes use the cores — 2-thread decoding collapses under
    contention — unless `allow_noisy`, in which case the numbers are flagged loudly, here and in the JSON."""
    other = other_busy_cores()
    quiet = other is None or other <= QUIET_MAX_OTHER_CORES
    record = {"when": when, "other_busy_cores": other, "quiet": quiet, "load_average_1m": load_average()}
    if not quiet:
        msg = (f"the machine is not quiet {when} the run: other processes keep {other:.2f} cores busy "
               f"(limit {QUIET_MAX_OTHER_CORES})")
        if not allow_noisy:
            print(f"laneplay bench: REFUSING to report: {msg}. Stop them and run again, or pass --allow-noisy to get "
                  "numbers flagged as noisy.", file=sys.stderr)
            raise SystemExit(3)
        print(f"WARNING: {msg}; every number below is NOISY and flagged so in the JSON.", file=sys.stderr)
    return record


_ENGINES: dict = {}


def default_engine(dtype: str = "float32", compile: bool = False, prefill_chunk: int | None = None):
    """Our engine on the embedded default model, loaded once per process for each (dtype, compile,
    prefill chunk): `laneplay bench` runs decode and prefill in one process, and both time the same
    weight paths."""
    from laneplay.engine import load_engine
    from laneplay.engine.runtime import PREFILL_CHUNK

    key = (dtype, bool(compile), prefill_chunk or PREFILL_CHUNK)
    if key not in _ENGINES:
        _ENGINES[key] = load_engine("smollm2-135m-instruct", dtype=dtype, compile=compile, prefill_chunk=key[2])
    return _ENGINES[key]


_HF_PEERS: dict = {}


@contextlib.contextmanager
def gguf_memo():
    """While transformers loads a GGUF file: open the file once, and build the GGUF-to-HF tensor-name map
    once. transformers opens the file for the config and again for the weights, and rebuilds the name
    map for every module it visits (~400 times on the default); with these two memos its load of the
    embedded default takes ~11 s less. The values are the ones it computes without them."""
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers, maps = {}, {}

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = real_map(arch, n_blocks)
        return maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


HF_GGUF_CACHE = "LANEPLAY_HF_GGUF_CACHE"  # a folder: keep transformers' conversions of GGUF files there


def hf_from_gguf(path: Path, **kwargs):
    """transformers' own GGUF loader on `path` (float32, eval mode), with `gguf_memo`.

    Where the environment names a folder in LANEPLAY_HF_GGUF_CACHE (the test suite does: its worker
    processes each need the same model), the first conversion of a file is saved there (its config and
    a safetensors file) and later processes load that with `from_pretrained`: the same tensors and config,
    without dequantizing again. The key is the file's name, size and modification time and the
    transformers version; a lock makes concurrent processes wait for one conversion."""
    import transformers

    def convert():
        with gguf_memo():
            return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                     dtype=torch.float32, **kwargs).eval()

    root = os.environ.get(HF_GGUF_CACHE)
    if not root:
        return convert()
    import fcntl
    import hashlib

    st = Path(path).stat()
    key = hashlib.sha256(f"{Path(path).name}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}".encode())
    folder = Path(root) / key.hexdigest()[:24]
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (folder / "config.json").is_file():
            model = convert()
            from safetensors.torch import save_model  # transformers refuses to save a model it loaded from GGUF

            part = folder.with_name(folder.name + ".part")
            config = copy.deepcopy(model.config)
            config.__dict__.pop("quantization_config", None)  # the saved tensors are plain float32
            config.save_pretrained(part)
            save_model(model, str(part / "model.safetensors"))
            part.rename(folder)
            return model
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **kwargs).eval()


def hf_peer():
    """Hugging Face transformers on the embedded default model's GGUF, dequantized to float32 (SDPA
    attention), loaded once per process: `laneplay bench` runs decode and prefill in one process, and
    converting the GGUF is most of a peer's load time."""
    if "model" not in _HF_PEERS:
        from laneplay.engine.checkpoint import resolve_checkpoint

        _HF_PEERS["model"] = hf_from_gguf(resolve_checkpoint("smollm2-135m-instruct"), attn_implementation="sdpa")
    return _HF_PEERS["model"]


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


def write_json(name: str, payload: dict, out: str | Path | None = None) -> Path:
    """Writes `<out or bench/results>/<name>.json` with the time and the machine."""
    folder = Path(out) if out else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    payload = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path
