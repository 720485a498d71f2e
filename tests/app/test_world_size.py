"""`laneplay serve --world-size auto`: the sizes that split a model, and the local engine that starts at 1,
reads its model's shapes, and starts again at the smallest size above 1 that splits it."""
import argparse

import pytest
from laneplay.app.cli import world_size
from laneplay.app.supervisor import LocalEngine, world_sizes


def test_the_sizes_that_divide_a_model():
    assert world_sizes({"arch": "llama", "num_heads": 9, "num_kv_heads": 3, "intermediate_size": 1536}) == [3]
    assert world_sizes({"arch": "llama", "num_heads": 32, "num_kv_heads": 8, "intermediate_size": 8192}) == [2, 4, 8]
    assert world_sizes({"arch": "laneformer", "num_lanes": 8, "num_heads": 9}) == [2, 4, 8]  # lanes, not heads
    assert world_sizes({"arch": "llama", "num_heads": 5, "num_kv_heads": 5, "intermediate_size": 55}) == [5]
    assert world_sizes({"arch": "llama", "num_heads": 9}) is None and world_sizes(None) is None


def test_the_world_size_argument_takes_a_number_or_auto():
    assert world_size("auto") == "auto" and world_size("3") == 3
    for bad in ("0", "9", "two"):
        with pytest.raises(argparse.ArgumentTypeError):
            world_size(bad)


def test_auto_starts_again_once_at_a_size_that_splits_the_model():
    eng = LocalEngine("m", world_size="auto")
    assert eng.world_size == 1  # the first start reads the model's shapes
    info = {"model": "m", "model_config": {"arch": "llama", "num_heads": 9, "num_kv_heads": 3,
                                           "intermediate_size": 1536}}
    assert eng._resize(info) is True and eng.world_size == 3 and "3 DTP ranks" in eng.detail
    assert eng._resize(info) is False and eng.world_size == 3  # once: a crash later restarts at 3
    one = LocalEngine("m", world_size="auto")
    assert one._resize({"model": "m", "model_config": {"arch": "llama", "num_heads": 11, "num_kv_heads": 11,
                                                       "intermediate_size": 121}}) is False
    assert one.world_size == 1  # nothing splits it: it stays at 1 and says so in its log
    assert LocalEngine("m", world_size=2)._resize(info) is False


def test_the_engine_is_the_process_it_started_not_whoever_answers_on_its_port():
    """The port is free when chosen, but the engine binds it only once its model is loaded: a server that
    took it meanwhile (another laneplay engine even) is never taken for ours."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    from laneplay.api_client import SyncEngineClient

    answers = {"pid": 4242}

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": "ok", "model": "other", "queue_depth": 0, "device": "cpu",
                               "pid": answers["pid"]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        eng = LocalEngine("m")
        eng.url, eng.proc = f"http://127.0.0.1:{http.server_address[1]}", SimpleNamespace(pid=1234)
        with SyncEngineClient(eng.url, timeout_s=30) as client:
            assert client.health()["pid"] == 4242  # a laneplay engine answers there...
        assert eng._probe() is None  # ...but not the one it started: not ready
        answers["pid"] = 1234
        info = None
        for _ in range(20):  # as the supervisor does: ask again (each probe waits 1 s at most)
            if (info := eng._probe()) is not None:
                break
        assert info is not None and info["model"] == "other"  # the process it started: ready
    finally:
        http.shutdown()
