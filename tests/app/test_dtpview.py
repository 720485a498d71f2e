"""The DTP tab's pure parts: when A/B is possible, its two requests, the timeline SVG, the table and the prediction."""
from types import SimpleNamespace

from laneplay.app import dtpview
from laneplay.app.dtpview import Run


def ctx(ready=True, **info):
    return SimpleNamespace(engine=SimpleNamespace(ready=ready, info=info, state="ready" if ready else "loading",
                                                  detail="" if ready else "loading the model"))


SMOLLM2 = {"arch": "llama", "num_heads": 9, "num_kv_heads": 3, "intermediate_size": 1536}  # the embedded default


def test_the_view_says_what_an_engine_lacks_and_which_world_sizes_split_the_model():
    ok, msg = dtpview.availability(ctx(model="smollm2", device="cpu", world_size=1, laneplay=True,
                                       model_config=SMOLLM2))
    assert ok is False and "world size 1" in msg and "laneplay serve --world-size 3" in msg  # 9 heads: not 2
    assert "The sizes that divide smollm2: 3." in msg and "--world-size 2" not in msg
    ok, msg = dtpview.availability(ctx(model="lf", device="cpu", world_size=1, laneplay=True,
                                       model_config={"arch": "laneformer", "num_lanes": 8}))
    assert "divide lf: 2, 4, 8." in msg and "--world-size 2`" in msg
    ok, msg = dtpview.availability(ctx(model="odd", device="cpu", world_size=1, laneplay=True,
                                       model_config={"arch": "llama", "num_heads": 11, "num_kv_heads": 11,
                                                     "intermediate_size": 121}))
    assert "No world size from 2 to 8 divides odd" in msg
    ok, msg = dtpview.availability(ctx(model="m", device="cpu", world_size=1, laneplay=True))  # shapes unknown
    assert "laneplay serve --world-size auto" in msg
    ok, msg = dtpview.availability(ctx(model="m", device="remote", world_size=None, laneplay=False))
    assert ok is False and "needs a Laneplay engine" in msg
    assert dtpview.availability(ctx(ready=False))[0] is None
    assert dtpview.availability(ctx(model="m", device="cpu", world_size=2, laneplay=True))[0] is True
    html = dtpview.status_html(ctx(model="m", device="cpu", world_size=1, laneplay=True, model_config=SMOLLM2))
    assert 'data-state="unavailable"' in html and "<code>laneplay serve --world-size 3</code>" in html


def test_ab_is_the_same_greedy_request_with_each_collectives():
    reqs = dtpview.ab_requests("complete", "def f(x):\n", "", 64)
    assert [c for c, _, _ in reqs] == ["delayed", "wait_now"]
    (_, a, chat_a), (_, b, chat_b) = reqs
    assert not chat_a and not chat_b and a["prompt"] == b["prompt"] == "def f(x):\n"
    assert a["temperature"] == 0 and a["max_tokens"] == 64 and a["ignore_eos"] is True
    assert a["laneplay"] == {"collectives": "delayed", "timeline": True, "speculative": "off"}  # a token per step
    assert b["laneplay"] == {"collectives": "wait_now", "timeline": True, "speculative": "off"}
    assert {k: v for k, v in a.items() if k != "laneplay"} == {k: v for k, v in b.items() if k != "laneplay"}


def rank(r, waited, exposed, steps=3):
    cols = {"ms": [10.0] * steps, "compute_ms": [6.0] * steps, "issued": [2 if waited else 0] * steps,
            "issue_ms": [0.5 if waited else 0.0] * steps, "waits": [2 if waited else 0] * steps,
            "waited_ms": [waited] * steps, "exposed": [0 if waited else 2] * steps, "exposed_ms": [exposed] * steps,
            "blocking": [2] * steps, "blocking_ms": [4.0 - waited - exposed] * steps}
    return {"rank": r, "decode_steps": steps, "first_step": 0, "steps": cols,
            "step": {"count": steps, "ms": 10.0 * steps},
            "issue": {"count": sum(cols["issued"]), "ms": sum(cols["issue_ms"])},
            "wait": {"count": sum(cols["waits"]), "ms": waited * steps},
            "exposed": {"count": sum(cols["exposed"]), "ms": exposed * steps},
            "blocking": {"count": 2 * steps, "ms": (4.0 - waited - exposed) * steps}, "compute_ms": 6.0 * steps}


def runs():
    return [Run("delayed", timing={"ms_per_token": 10.0, "decode_tokens_per_second": 100.0,
                                   "timeline": {"ranks": [rank(0, 0.5, 0.0), rank(1, 0.5, 0.0)]}}),
            Run("wait_now", timing={"ms_per_token": 12.0, "decode_tokens_per_second": 83.3,
                                    "timeline": {"ranks": [rank(0, 0.0, 2.0), rank(1, 0.0, 2.0)]}})]


def test_hidden_share_compares_the_exposed_waits_of_both_modes():
    d, w = (r.timeline for r in runs())
    assert dtpview.exposed_comm_ms(d) == 0.5 and dtpview.exposed_comm_ms(w) == 2.0
    assert dtpview.hidden_share(d, w) == 0.75
    assert dtpview.hidden_share(d, None) is None


def test_the_timeline_has_a_row_per_mode_and_rank_and_the_table_both_modes():
    svg = dtpview.timeline_svg(runs())
    assert svg.startswith('<svg id="dtp-timeline"') and 'data-rows="4"' in svg
    for mode in ("delayed", "wait_now"):
        for r in (0, 1):
            assert f'data-mode="{mode}" data-rank="{r}" data-steps="3"' in svg
    assert svg.count("<title>") == 12 and 'data-kind="exposed"' in svg and 'data-kind="waited"' in svg
    table = dtpview.table_html(runs())
    assert 'data-ms-delayed="10.000"' in table and 'data-ms-wait="12.000"' in table
    assert 'data-hidden-share="0.7500"' in table and table.count("<tr data-mode=") == 2 and "75%" in table
    assert 'data-rows="0"' in dtpview.timeline_svg([]) and 'data-modes="0"' in dtpview.table_html([])


def test_a_model_whose_collectives_all_block_says_the_delay_has_nothing_to_hide():
    """Both modes ran and neither waited on a delayed sum (standard tensor parallelism): the summary says so,
    instead of asking for both modes again."""
    blocking = [Run(m, timing={"ms_per_token": 10.0, "decode_tokens_per_second": 100.0,
                               "timeline": {"ranks": [rank(0, 0.0, 0.0), rank(1, 0.0, 0.0)]}})
                for m in ("delayed", "wait_now")]
    table = dtpview.table_html(blocking)
    assert 'data-hidden-share=""' in table and "nothing to hide" in table and "Run both modes" not in table
    assert "Run both modes" in dtpview.table_html(blocking[:1])  # one mode: the other is still to run


def test_the_prediction_is_for_the_served_model_when_it_splits_over_8_gpus_else_laneformer_2b():
    from laneplay.engine.checkpoint import tiny_laneformer_config
    from laneplay.engine.config import config_from_hf

    lanes8 = config_from_hf(tiny_laneformer_config(num_lanes=8, num_attention_heads=16, num_key_value_heads=8),
                            name="tiny").to_dict()
    pred = dtpview.prediction(lanes8, "tiny")
    if not pred["available"]:  # the performance model is not in this checkout
        assert "performance model not available" in dtpview.prediction_html(pred)
        return
    assert pred["for"] == "engine" and pred["p"].tokens_per_s_dtp > 0
    html = dtpview.prediction_html(pred)
    assert 'id="dtp-prediction"' in html and "On 8×H200 this model would decode at" in html
    four = config_from_hf(tiny_laneformer_config(), name="four-lanes").to_dict()  # 4 lanes: not over 8 GPUs
    fallback = dtpview.prediction(four, "four-lanes")
    assert fallback["for"] == "laneformer-2b" and fallback["model"] == "Laneformer 2B"
    html = dtpview.prediction_html(fallback)
    assert "Laneformer 2B would decode at" in html and "four-lanes" in html
    assert dtpview.prediction(None, None)["for"] == "laneformer-2b"
