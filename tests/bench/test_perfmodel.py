"""The batch-1 decode performance model (laneplay/perfmodel.py): bytes, schedule, presets; and its command
line (bench/perfmodel.py)."""
import argparse
import json
import math
from dataclasses import replace

import pytest

from laneplay import perfmodel as pm
from laneplay.bench import perfmodel as cli

SPEC_PARAMS = 2_320_069_632  # Laneformer 2B, docs/laneformer.md §10


def independent_param_count(raw: dict) -> int:
    """From the config's shapes alone (replicated norms, untied replicate head)."""
    D, F, V = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"]
    hd = D // raw["num_attention_heads"]
    q = raw["num_attention_heads"] * hd
    kv = raw["num_key_value_heads"] * hd
    layer = D * q + 2 * D * kv + q * D + 3 * D * F + 2 * D
    return V * D + raw["num_hidden_layers"] * layer + D + V * D


def one_gpu(**kw) -> pm.Node:
    return replace(pm.node_preset("1xH200"), **kw)


def test_bytes_per_token_matches_parameter_count():
    raw = pm.LANEFORMER_2B
    n = independent_param_count(raw)
    assert n == SPEC_PARAMS
    p = pm.predict(None, one_gpu(dtype_bytes=2), position=0)
    assert p.param_count == n
    assert p.weight_bytes == n * 2
    # A decode step reads every weight once except the embedding table, of which it reads one row.
    read = (n - raw["vocab_size"] * raw["hidden_size"] + raw["hidden_size"]) * 2
    assert p.bytes_per_token == pytest.approx(read, rel=0.01)
    assert p.bytes_per_token == pytest.approx(n * 2, rel=0.05)  # the table is 4.2% of the parameters
    assert p.kv_bytes_per_device < 1e-4 * p.bytes_per_token  # position 0: KV negligible


def test_bytes_split_across_devices_and_kv_grows_until_the_window():
    one = pm.predict(None, one_gpu(), position=0)
    eight = pm.predict(None, "8xH200", position=0)
    assert eight.bytes_per_device == pytest.approx(one.bytes_per_device / 8, rel=0.01)
    cfg = pm.resolve_config(None)
    kv = lambda pos: pm.device_bytes(cfg, 1, 2, pos).kv  # noqa: E731
    per_pos_all = 2 * cfg.num_kv_heads * cfg.head_dim * 2 * cfg.num_layers
    assert kv(1000) - kv(999) == pytest.approx(per_pos_all)  # below the window every layer grows
    full = cfg.num_layers - len(cfg.swa_layers)
    assert kv(3000) - kv(2999) == pytest.approx(per_pos_all * full / cfg.num_layers)  # past it only full layers


def test_free_communication_makes_dtp_equal_tp():
    node = pm.node_preset("8xH200", collective_us=0.0, collective_gbps=math.inf)
    p = pm.predict(None, node)
    assert p.ms_per_token_dtp == p.ms_per_token_tp
    assert p.exposed_comm_ms_tp == p.exposed_comm_ms_dtp == 0.0


def layer_compute_us(cfg, node, position):
    nb = pm.device_bytes(cfg, node.gpus, node.dtype_bytes, position)
    bw = node.device_gbps * 1e3
    return [(a + m) / bw + node.kernels_per_layer * node.launch_us for a, m in zip(nb.attention, nb.mlp)]


def test_large_latency_dtp_hides_at_most_delay_layers_per_collective():
    cfg = pm.resolve_config(None)
    c = 5000.0  # µs, far above any layer's compute
    node = pm.node_preset("8xH200", collective_us=c, collective_gbps=math.inf)
    p = pm.predict(cfg, node, position=100)
    layers = layer_compute_us(cfg, node, 100)
    window_max = cfg.broadcast_delay * max(layers)
    # TP blocks on every collective; DTP on fewer, and each delayed one is covered by <= d layers of compute.
    fewer = (p.collectives_tp - p.collectives_dtp_blocking - p.collectives_dtp_delayed) * c
    saved_us = (p.exposed_comm_ms_tp - p.exposed_comm_ms_dtp) * 1e3 - fewer
    assert p.exposed_comm_ms_dtp < p.exposed_comm_ms_tp
    assert 0 < saved_us <= p.collectives_dtp_delayed * window_max * (1 + 1e-9)
    assert saved_us <= sum(layers)  # one communication stream: it can only hide behind the step's compute


def test_each_delayed_collective_hides_exactly_its_window():
    # d = 1, attention-only exchange: one collective in flight at a time, so nothing queues and each one,
    # longer than its window, hides exactly the compute between issue (after attention i) and wait
    # (after attention i + 1): MLP i + attention i + 1.
    raw = dict(pm.LANEFORMER_2B, broadcast_delay=1, use_mlp_comm=False)
    cfg = pm.resolve_config(raw)
    c = 200.0
    node = pm.node_preset("8xH200", collective_us=c, collective_gbps=math.inf)
    nb = pm.device_bytes(cfg, node.gpus, node.dtype_bytes, 100)
    sub = lambda b: b / (node.device_gbps * 1e3) + node.kernels_per_layer / 2 * node.launch_us  # noqa: E731
    issued = range(1, cfg.num_layers - 1)  # layer 0 reduces at once (use_early_comm); the last issues nothing
    window = [sub(nb.mlp[i]) + sub(nb.attention[i + 1]) for i in issued]
    assert max(window) < c
    p = pm.predict(cfg, node, position=100)
    assert p.collectives_dtp_delayed == len(window)
    fewer = (p.collectives_tp - p.collectives_dtp_blocking - p.collectives_dtp_delayed) * c
    saved_us = (p.exposed_comm_ms_tp - p.exposed_comm_ms_dtp) * 1e3 - fewer
    assert saved_us == pytest.approx(sum(window), rel=1e-9)
    # and a collective shorter than its window is hidden completely
    q = pm.predict(cfg, replace(node, collective_us=min(window) / 2), position=100)
    assert q.exposed_comm_ms_dtp * 1e3 == pytest.approx(q.collectives_dtp_blocking * min(window) / 2, rel=1e-9)


def test_schedule_counts_follow_the_dtp_schedule():
    p = pm.predict(None, "8xH200")
    assert p.collectives_tp == 2 * 15 + 1  # two per layer + the argmax gather of the vocabulary shards
    assert p.collectives_dtp_blocking == 4 + 2  # layers 0-1 (use_early_comm) + the final two
    assert p.collectives_dtp_delayed == 2 * (15 - 2 - 2)  # layers 2..12 issue, the last two do not
    early_off = dict(pm.LANEFORMER_2B, use_early_comm=False)
    q = pm.predict(early_off, "8xH200")
    assert (q.collectives_dtp_blocking, q.collectives_dtp_delayed) == (2, 26)  # docs/laneformer.md §9.3: layers 0-12 issue
    assert q.ms_per_token_dtp < p.ms_per_token_dtp


def test_more_bandwidth_is_faster_and_one_gpu_has_no_communication():
    slow = pm.predict(None, pm.node_preset("8xH200", hbm_gbps=3000.0))
    fast = pm.predict(None, pm.node_preset("8xH200", hbm_gbps=6000.0))
    assert fast.tokens_per_s_tp > slow.tokens_per_s_tp and fast.tokens_per_s_dtp > slow.tokens_per_s_dtp
    assert pm.predict(None, pm.node_preset("8xH200", bw_efficiency=0.9)).tokens_per_s_dtp > slow.tokens_per_s_dtp
    single = pm.predict(None, "1xH200")
    assert single.exposed_comm_ms_tp == single.comm_ms_dtp == 0.0 and single.hidden_share == 0.0


def test_predict_accepts_engine_config_objects(tmp_path):
    from laneplay.engine.config import config_from_hf

    cfg = config_from_hf(pm.LANEFORMER_2B)
    base = pm.predict(cfg, "8xH200").ms_per_token_dtp

    class FakeEngine:
        pass

    eng = FakeEngine()
    eng.cfg = cfg
    assert pm.predict(eng, "8xH200").ms_per_token_dtp == base
    path = tmp_path / "config.json"
    path.write_text(json.dumps(pm.LANEFORMER_2B))
    assert pm.predict(str(path), "8xH200").ms_per_token_dtp == base
    llama = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
             "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8}
    p = pm.predict(llama, "8xH200")  # no delay: DTP is standard TP
    assert p.ms_per_token_dtp == p.ms_per_token_tp and p.collectives_tp == 2 * 4 + 1


def test_presets_load_with_sources():
    for name in pm.PRESETS:
        node = pm.node_preset(name)
        assert node.gpus >= 1 and node.hbm_gbps > 0
        assert all(k in node.sources for k in ("hbm_gbps", "bw_efficiency", "collective_us"))
    h200 = pm.node_preset("8xH200")  # calibrated by the H200 run in bench/results/gpu-check.json
    assert all(h200.sources[k].startswith("calibrated: measured, bench/results/gpu-check.json")
               for k in ("hbm_gbps", "bw_efficiency", "launch_graph_us"))
    assert pm.node_preset("8xMI300X").sources["calibration"] == "not calibrated: no GPU run yet"
    with pytest.raises(pm.PerfModelError, match="unknown node preset"):
        pm.node_preset("4xB200")


def test_calibration_from_result_files(tmp_path):
    cpu = pm.node_preset("cpu", results=tmp_path)  # no result files: everything assumed
    assert not any(s.startswith("calibrated") for s in cpu.sources.values())
    (tmp_path / "decode-cpu.json").write_text(json.dumps({
        "bandwidth": {"before": {"read_gbps": 30.0}, "after": {"read_gbps": 34.0}},
        "rows": [{"engine": "ours (compiled)", "gbps": 16.0}]}))
    (tmp_path / "gpu-h200.json").write_text(json.dumps({"device": "NVIDIA H200", "collective_us": 4.5}))
    cpu = pm.node_preset("cpu", results=tmp_path)
    assert cpu.hbm_gbps == 32.0 and cpu.bw_efficiency == 0.5
    assert cpu.sources["bw_efficiency"].startswith("calibrated")
    h200 = pm.node_preset("8xH200", results=tmp_path)
    assert h200.collective_us == 4.5 and "calibration" not in h200.sources
    assert pm.node_preset("8xMI300X", results=tmp_path).collective_us == 5.0


def parse(argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(argv)


def test_cli_json_and_tables(capsys):
    assert cli.run(parse(["--json", "--no-write", "--node", "8xH200,8xMI300X"])) == 0
    rep = json.loads(capsys.readouterr().out)
    by_node = {e["node"]["name"]: e for e in rep["nodes"]}
    assert by_node["8xH200"]["kog"]["tokens_per_s"] == 2100
    assert by_node["8xMI300X"]["kog"]["tokens_per_s"] == 3000
    assert by_node["8xH200"]["prediction"]["tokens_per_s_dtp"] > by_node["8xH200"]["prediction"]["tokens_per_s_tp"]
    assert cli.run(parse(["--no-write", "--node", "8xH200", "--eager", "--collective-us", "20"])) == 0
    out = capsys.readouterr().out
    assert "Assumptions for 8xH200" in out and "collective_us      20" in out and "set on the command line" in out
    assert "calibrated: measured, bench/results/gpu-check.json" in out and "Kog on 8xH200" in out
    assert "standard TP" in out


def test_cli_registered():
    from laneplay.cli import COMMANDS

    assert COMMANDS["perfmodel"][0] == "laneplay.bench.perfmodel"


@pytest.mark.parametrize("argv, message", [
    (["--hbm-gbps", "-1"], "--hbm-gbps must be > 0"),
    (["--bw-efficiency", "1.5"], "fraction in (0, 1]"),
    (["--dtype", "int3"], "--dtype must be one of"),
    (["--gpus", "two"], "--gpus must be a number"),
])
def test_bad_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--node", "9xH100"], "unknown node preset"),
    (["--gpus", "3"], "gpus (3) must divide num_lanes (8)"),
    (["--config", "/nonexistent/config.json"], "no config.json"),
])
def test_bad_values_give_clear_errors(argv, message, capsys):
    assert cli.run(parse(argv + ["--no-write"])) == 2
    assert message in capsys.readouterr().err


def test_gpu_check_calibration_from_a_run():
    import runpy
    from pathlib import Path

    calibration = runpy.run_path(str(Path(cli.__file__).parent / "gpu_check.py"), run_name="gpu_check")["calibration"]
    run = {"gpu": "NVIDIA H200", "bandwidth": {"read_GBps": 4000.0}, "models": [{
        "model": "laneformer-2b-shaped (random weights)", "weight_bytes": 4_000_000_000 + 32000 * 3072 * 2,
        "config": {"vocab_size": 32000, "hidden_size": 3072},
        "variants": {"CUDA graph, cuBLAS GEMV": {"ms_per_token": 1.5}, "eager torch": {"ms_per_token": 9.0}},
        "kernel_profile": [{"kernel": "nvjet_sm90_x", "calls": 60, "us_per_step": 1250.0},
                           {"kernel": "_residual_kernel", "calls": 40, "us_per_step": 100.0}]}]}
    c = calibration(run)
    assert c["device"] == "NVIDIA H200" and c["hbm_gbps"] == 4000.0
    assert c["bw_efficiency"] == 0.8  # 4.0 GB in 1,250 us = 3.2 TB/s of 4.0
    assert c["launch_us"] == 2.5  # (1,500 - 1,250) us over 100 kernels
    assert calibration({"gpu": "x", "bandwidth": {}}) == {}
