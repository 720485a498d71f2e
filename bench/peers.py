"""The llama.cpp peer of `laneplay bench`: how `make bench-peers` builds it for this CPU, and the check
that a built peer runs here before anything is timed.

    python -m laneplay.bench.peers cmake-flags     # the ggml options for this machine, one line

A build may use only the instruction-set extensions this CPU has. Each x86 extension that ggml compiles
code for is switched on only when the kernel lists it in /proc/cpuinfo: an AVX-512 CPU need not have the
VEX-encoded AVX-VNNI (AMD EPYC has AVX-512 VNNI but not AVX-VNNI), and a build that assumes it dies with
SIGILL on its first product. AMX stays off everywhere (ggml's AMX repack path crashes on the default
model). A CPU that lists none of these flags (not x86) builds native.
"""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

# /proc/cpuinfo flag -> ggml's cmake option that compiles code with it.
EXTENSIONS = (
    ("sse4_2", "GGML_SSE42"), ("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("fma", "GGML_FMA"),
    ("f16c", "GGML_F16C"), ("bmi2", "GGML_BMI2"), ("avx_vnni", "GGML_AVX_VNNI"),
    ("avx512vbmi", "GGML_AVX512_VBMI"), ("avx512_vnni", "GGML_AVX512_VNNI"), ("avx512_bf16", "GGML_AVX512_BF16"),
)
# GGML_AVX512 compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw: all five or nothing.
AVX512 = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")
# The AVX-512 extensions ggml uses only on top of GGML_AVX512.
NEEDS_AVX512 = {"GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16"}
ALWAYS_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The flags of the first CPU in /proc/cpuinfo (or in the given text); empty where there are none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def llama_cmake_flags(flags: set[str]) -> list[str]:
    """ggml's cmake options for a CPU with these /proc/cpuinfo flags: each extension on exactly when the
    CPU has it (explicit, not native), AMX off; native where no x86 flag is known."""
    if "avx" not in flags and "sse4_2" not in flags:
        return ["-DGGML_NATIVE=ON", *(f"-D{o}=OFF" for o in ALWAYS_OFF)]
    avx512 = all(f in flags for f in AVX512)
    out = ["-DGGML_NATIVE=OFF", f"-DGGML_AVX512={'ON' if avx512 else 'OFF'}"]
    for flag, option in EXTENSIONS:
        on = flag in flags and (avx512 or option not in NEEDS_AVX512)
        out.append(f"-D{option}={'ON' if on else 'OFF'}")
    return out + [f"-D{o}=OFF" for o in ALWAYS_OFF]


def crash_reason(returncode: int) -> str:
    """Why a peer process ended, in words (SIGILL: it was built for instructions this CPU lacks)."""
    if returncode == -signal.SIGILL:
        return ("it died with SIGILL (an instruction this CPU does not have): it was built for another CPU; "
                "rebuild it here with `make bench-peers`")
    if returncode < 0:
        return f"it was killed by signal {signal.Signals(-returncode).name}"
    return f"it exited with code {returncode}"


# Loads the GGUF and decodes a few tokens: every product kernel the timed run uses runs once.
_SMOKE = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, n_threads=int(sys.argv[2]), flash_attn=True,
                      seed=0, verbose=False)
out = llm.create_completion("def add(a, b):", max_tokens=4, temperature=0.0)
assert out["choices"][0]["text"] is not None
"""


def check_llama_cpp(model_path: str, threads: int, timeout_s: float = 300.0) -> str | None:
    """None when llama-cpp-python loads `model_path` and decodes in a child process here, else why not
    (in a child: a peer built for another CPU kills its process with SIGILL, not with an exception)."""
    try:
        r = subprocess.run([sys.executable, "-c", _SMOKE, model_path, str(threads)], capture_output=True,
                           text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"llama.cpp did not answer a 4-token request within {timeout_s:.0f} s"
    if r.returncode == 0:
        return None
    tail = (r.stderr.strip().splitlines() or [""])[-1][-300:]
    return f"llama.cpp does not run here: {crash_reason(r.returncode)}{': ' + tail if tail else ''}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["cmake-flags"]:
        print("usage: python -m laneplay.bench.peers cmake-flags", file=sys.stderr)
        return 2
    print(" ".join(llama_cmake_flags(cpu_flags())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
