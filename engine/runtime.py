"""The runtime record: where and how a model runs (device, dtype, backend, threads, compile).

It is decided once, by `load_engine`, and handed whole to whatever runs the model: the local runner,
or every DTP rank (which only derives its own device index from it). Nothing else picks a device,
parses a dtype or decides whether to compile.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
# Weight-only low-bit paths (CPU, `kernels.lowbit`): projections packed as int8 or 4-bit blocks, the LM
# head as int8, the KV cache float16 (`kernels.lowbit.KV_DTYPE`), everything else (activations, norms)
# float32.
LOWBIT = ("int4", "int8")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", *LOWBIT)
# What "auto" picks on the CPU at world size 1 when the low-bit kernels are built, chosen by measurement
# (bench/results/lowbit-quality.json and decode-cpu.json): the fastest path whose quality holds.
CPU_DEFAULT = "int4"
# Prompt tokens per prefill step. Small enough that a prompt joining running requests stalls them for one
# short step at a time and that a reused prefix (engine/batch.py PrefixCache) is taken in fine pieces; a
# prompt chunk is still a float GEMM of 128 rows, which costs about what 512-row ones do on the CPU path.
PREFILL_CHUNK = 128


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {', '.join(DTYPE_CHOICES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPE_CHOICES)}")
    return DTYPES[dtype]


def parse_device(device: str | torch.device | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not supported; use 'cpu' or 'cuda'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported; use 'cpu' or 'cuda'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but no CUDA GPU is available; use device='cpu'")
    return dev


@dataclass(frozen=True)
class Runtime:
    """Everything about how the model runs, in plain values (it crosses process boundaries)."""

    device: str  # "cpu", "cuda" or "cuda:i"; a DTP rank runs on `rank_device(rank)`
    dtype: str  # "float32" | "bfloat16" | "float16" | "int8" | "int4" (low-bit weights, float32 compute)
    world_size: int = 1
    backend: str | None = None  # torch.distributed backend of the DTP ranks: "gloo" (CPU) or "nccl" (CUDA)
    threads: int = 1  # intra-op threads per process (each rank gets its share of the cores)
    compile: bool = False  # compile the per-token decode blocks (paid at load, never inside a request)
    kv_budget_bytes: int = 0  # the most KV cache one request may reserve (0: no limit)
    prefill_chunk: int = PREFILL_CHUNK  # prompt tokens per prefill step (bounds attention memory and how long a stop waits)
    graphs: bool = False  # decode through the static step (`engine.static_step`); captured on CUDA at world size 1

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype activations and unpacked weights use (and the KV cache, but on low-bit paths)."""
        return torch.float32 if self.dtype in LOWBIT else DTYPES[self.dtype]

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype the KV cache holds: the activations' dtype, or float16 on the low-bit paths."""
        if self.dtype in LOWBIT:
            from laneplay.kernels import lowbit

            return lowbit.KV_DTYPE
        return self.torch_dtype

    @property
    def weight_format(self) -> str | None:
        """"int8" / "int4" when the projections are packed low-bit weights, else None."""
        return self.dtype if self.dtype in LOWBIT else None

    def rank_device(self, rank: int) -> str:
        """Rank r's device: one GPU per rank on CUDA, the CPU otherwise."""
        if self.torch_device.type != "cuda":
            return self.device
        return f"cuda:{rank % max(1, torch.cuda.device_count())}"

    def for_rank(self, rank: int) -> "Runtime":
        return replace(self, device=self.rank_device(rank))

    def to_dict(self) -> dict:
        return asdict(self)


KV_BUDGET_FRACTION = {"cpu": 0.2, "cuda": 0.4}  # of the machine's memory (CPU) or the GPU's, by default


def default_kv_budget(dev: torch.device) -> int:
    """A KV budget from the machine: a fifth of RAM on CPU, 40% of the GPU's memory on CUDA."""
    if dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total * KV_BUDGET_FRACTION[dev.type])


def make_runtime(device: str | torch.device | None = "cpu", dtype="float32", world_size: int = 1,
                 compile="auto", threads: int | None = None, kv_budget_gb: float | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, graphs="auto") -> Runtime:
    """Validate and resolve the caller's choices into one Runtime.

    compile: True / False, or "auto": compiled on CPU at world size 1, where per-op overhead dominates;
    under DTP "auto" runs eagerly (the ranks share the cores, and each would pay the compile), while an
    explicit `compile=True` is honoured by every rank.
    graphs: True / False, or "auto": decode through the static step (`engine.static_step`), captured as one
    CUDA graph per batch size on CUDA at world size 1 ("auto" turns it on there). True elsewhere runs the
    same step without capture: on the CPU through the torch references, on DTP ranks with their collectives.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    dev = parse_device(device)
    if dtype == "auto":  # the measured CPU default; float32 elsewhere (and without the kernels)
        from laneplay.kernels import lowbit

        dtype = CPU_DEFAULT if dev.type == "cpu" and lowbit.available() else "float32"
    if dtype in LOWBIT:
        from laneplay.kernels import lowbit

        if dev.type != "cpu":
            raise ValueError(f"dtype {dtype!r} (low-bit weights) runs on the CPU only; on CUDA use float16 or bfloat16")
        lowbit.require()
        dt = torch.float32
    else:
        dt = parse_dtype(dtype)
    if dev.type == "cuda" and world_size > 1 and torch.cuda.device_count() < world_size:
        raise ValueError(f"world_size {world_size} needs {world_size} GPUs, this machine has "
                         f"{torch.cuda.device_count()}")
    if compile not in (True, False, "auto"):
        raise ValueError(f"compile must be True, False or 'auto', got {compile!r}")
    if compile == "auto":
        compile = dev.type == "cpu" and world_size == 1
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size) if world_size > 1 else torch.get_num_threads()
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    if kv_budget_gb is None:
        kv_budget = default_kv_budget(dev)
    elif isinstance(kv_budget_gb, (int, float)) and not isinstance(kv_budget_gb, bool) and kv_budget_gb > 0:
        kv_budget = int(kv_budget_gb * 2**30)
    else:
        raise ValueError(f"kv_budget_gb must be a positive number of GiB, got {kv_budget_gb!r}")
    if not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
    if graphs not in (True, False, "auto"):
        raise ValueError(f"graphs must be True, False or 'auto', got {graphs!r}")
    if graphs == "auto":
        graphs = dev.type == "cuda" and world_size == 1
    if dtype in LOWBIT:
        compile = False  # the low-bit decode blocks are already fused C calls; nothing to compile
        if graphs:
            raise ValueError("the static decode step (graphs=True) does not run low-bit weights")
    name = dtype if dtype in LOWBIT else next(k for k, v in DTYPES.items() if v == dt and "fp" not in k and k != "bf16")
    backend = ("nccl" if dev.type == "cuda" else "gloo") if world_size > 1 else None
    return Runtime(device=str(dev), dtype=name, world_size=world_size, backend=backend, threads=threads,
                   compile=bool(compile), kv_budget_bytes=kv_budget, prefill_chunk=prefill_chunk,
                   graphs=bool(graphs))
