"""The llama.cpp peer's build options (bench/peers.py): each instruction-set extension on exactly when the
CPU lists it, for both answers of the CPU probe (AVX2 only; AVX-512 without the VEX AVX-VNNI), and the
cmake command `make bench-peers` would run on this machine (a dry run, nothing is built)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from laneplay.bench import peers

ROOT = Path(__file__).resolve().parents[2]
# Flags as /proc/cpuinfo lists them (abridged to what the choice reads, plus neighbours it must ignore).
AVX2_ONLY = set("fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma bmi1 bmi2 avx2 aes pclmulqdq popcnt".split())
AVX512_NO_AVX_VNNI = AVX2_ONLY | set("avx512f avx512dq avx512cd avx512bw avx512vl avx512ifma avx512vbmi "
                                     "avx512_vbmi2 avx512_vnni avx512_bf16 avx512_bitalg avx512_vpopcntdq".split())


def options(flags: set[str]) -> dict[str, str]:
    out = {}
    for arg in peers.llama_cmake_flags(flags):
        name, value = re.fullmatch(r"-D(\w+)=(ON|OFF)", arg).groups()
        assert name not in out, f"{name} given twice"
        out[name] = value
    return out


def test_an_avx2_only_cpu_gets_avx2_and_no_avx512_or_vnni():
    o = options(AVX2_ONLY)
    assert o["GGML_NATIVE"] == "OFF"
    assert {k: o[k] for k in ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_SSE42")} == \
        dict.fromkeys(("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_SSE42"), "ON")
    assert {k: o[k] for k in ("GGML_AVX_VNNI", "GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16",
                              "GGML_AVX512_VBMI", "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")} == \
        dict.fromkeys(("GGML_AVX_VNNI", "GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16",
                       "GGML_AVX512_VBMI", "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"), "OFF")


def test_an_avx512_cpu_without_vex_vnni_gets_avx512_vnni_but_not_avx_vnni():
    o = options(AVX512_NO_AVX_VNNI)
    assert o["GGML_AVX512"] == o["GGML_AVX512_VNNI"] == o["GGML_AVX512_BF16"] == o["GGML_AVX512_VBMI"] == "ON"
    assert o["GGML_AVX_VNNI"] == "OFF"  # the option whose code dies with SIGILL on AMD EPYC
    assert o["GGML_AVX2"] == o["GGML_FMA"] == "ON" and o["GGML_NATIVE"] == "OFF"


def test_vex_vnni_is_on_where_listed_and_amx_is_always_off():
    o = options(AVX512_NO_AVX_VNNI | {"avx_vnni", "amx_tile", "amx_int8", "amx_bf16"})
    assert o["GGML_AVX_VNNI"] == "ON"
    assert o["GGML_AMX_TILE"] == o["GGML_AMX_INT8"] == o["GGML_AMX_BF16"] == "OFF"


def test_avx512_needs_all_five_base_extensions():
    no_bw = AVX512_NO_AVX_VNNI - {"avx512bw"}  # ggml's AVX512 option compiles with -mavx512bw
    o = options(no_bw)
    assert o["GGML_AVX512"] == o["GGML_AVX512_VNNI"] == o["GGML_AVX512_BF16"] == "OFF"
    assert o["GGML_AVX2"] == "ON"


def test_a_cpu_without_x86_flags_builds_native():
    o = options(set("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics asimddp".split()))
    assert o["GGML_NATIVE"] == "ON" and o["GGML_AMX_INT8"] == "OFF" and "GGML_AVX2" not in o


def test_cpu_flags_reads_the_first_flags_line():
    text = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f\nbugs\t\t: x\n" \
           "processor\t: 1\nflags\t\t: fpu\n"
    assert peers.cpu_flags(text) == {"fpu", "avx2", "avx512f"}
    assert peers.cpu_flags("processor : 0\n") == set()


def test_this_machine_gets_only_extensions_it_lists():
    flags = peers.cpu_flags()
    names = dict(peers.EXTENSIONS)
    for option, value in options(flags).items():
        if value == "ON" and option in names.values():
            flag = next(f for f, o in peers.EXTENSIONS if o == option)
            assert flag in flags, f"{option} is on, but /proc/cpuinfo does not list {flag}"
    assert names  # the table is not empty


def test_make_bench_peers_passes_the_same_options_to_both_builds():
    """A dry run (make -n; the venv taken as built): the pip build and the llama-server cmake line both
    get exactly the options of this CPU."""
    want = " ".join(peers.llama_cmake_flags(peers.cpu_flags()))
    r = subprocess.run(["make", "-n", "--no-print-directory", "-o", ".venv/.laneplay-installed", f"PY={sys.executable}",
                        "LLAMA_SERVER=.venv/llama-server-dry-run", "bench-peers"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f'CMAKE_ARGS="{want}"' in r.stdout
    lines = r.stdout.replace("\\\n", " ").splitlines()  # continued lines joined
    cmake = [ln for ln in lines if ln.startswith("cmake -S")]
    assert cmake and want in cmake[0]


@pytest.mark.parametrize("code, words", [(-4, "SIGILL"), (-9, "SIGKILL"), (3, "exited with code 3")])
def test_a_crashed_peer_is_named_by_its_signal(code, words):
    assert words in peers.crash_reason(code)
    if code == -4:
        assert "make bench-peers" in peers.crash_reason(code)
