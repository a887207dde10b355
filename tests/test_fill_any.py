"""benchmarks/fill_any.py: its verdicts and ratios on canned numbers (a bug here would misreport
a target as met), and its simulator profiles (benchmarks/profiles/) load, validate and have the
shapes the benchmark is about (engine model in virtual time: deterministic, not a timing test)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import fill_any

from loadtest.sim.calibrate import closed_loop
from loadtest.sim.cli import plan
from loadtest.sim.profiles import Profile, load_profile, profile_path


def _rows(key: str, *values: float | None) -> list[dict]:
    return [{key: v} for v in values]


# -- verdicts ---------------------------------------------------------------------------------
def test_single_verdict_is_the_median_of_each_repeats_ratio():
    direct = _rows("output_tok_s", 700.0, 800.0, 1000.0)
    proxy = _rows("output_tok_s", 700.0, 600.0, 960.0)  # ratios 1.0, 0.75, 0.96
    v = fill_any.single_verdict(direct, proxy)
    assert v["per_repeat"] == pytest.approx([1.0, 0.75, 0.96])
    assert v["ratio"] == pytest.approx(0.96) and v["met"]


def test_single_verdict_threshold_and_gaps():
    assert fill_any.single_verdict(_rows("output_tok_s", 100.0), _rows("output_tok_s", 95.0))["met"]
    assert not fill_any.single_verdict(_rows("output_tok_s", 100.0), _rows("output_tok_s", 94.0))[
        "met"
    ]
    # a repeat that measured nothing (no tokens direct, or no number) cannot pass
    for direct, proxy in [((0.0, 100.0), (50.0, 100.0)), ((100.0, 100.0), (None, 100.0))]:
        v = fill_any.single_verdict(_rows("output_tok_s", *direct), _rows("output_tok_s", *proxy))
        assert v["ratio"] is None and not v["met"]


def test_pair_verdict_needs_both_throughput_and_tail():
    router = [{"output_tok_s": 1000.0, "ttft_p99": 4.0}]
    met = fill_any.pair_verdict(router, [{"output_tok_s": 1140.0, "ttft_p99": 2.12}])
    assert met["tok_s"] == pytest.approx(1.14) and met["ttft_p99"] == pytest.approx(0.53)
    assert met["met"]
    assert not fill_any.pair_verdict(router, [{"output_tok_s": 1090.0, "ttft_p99": 1.0}])["met"]
    assert not fill_any.pair_verdict(router, [{"output_tok_s": 1500.0, "ttft_p99": 2.5}])["met"]


def test_open_verdict_served_tail_and_shedding():
    router = [{"request_throughput": 12.0, "ttft_sent_p99": 19.0}]

    def proxy(served: float, ttft: float, shed: int) -> list[dict]:
        return [{"request_throughput": served, "ttft_sent_p99": ttft, "shed": shed}]

    v = fill_any.open_verdict(router, proxy(12.0, 5.0, 10))
    assert v["served"] == 1.0 and v["ttft_p99"] == pytest.approx(5 / 19) and v["met"]
    assert not fill_any.open_verdict(router, proxy(11.9, 5.0, 10))["met"]  # served less
    assert not fill_any.open_verdict(router, proxy(13.0, 20.0, 10))["met"]  # longer tail
    assert not fill_any.open_verdict(router, proxy(13.0, 5.0, 0))["met"]  # shed nothing


def test_open_verdict_judges_loadtests_finished_in_window_ttft_not():
    # the router's own (finished-in-window) TTFT is low; the one judged is of requests sent
    router = [{"request_throughput": 12.0, "ttft_p99": 0.2, "ttft_sent_p99": 19.0}]
    proxy = [{"request_throughput": 13.0, "ttft_p99": 5.0, "ttft_sent_p99": 5.5, "shed": 3}]
    assert fill_any.open_verdict(router, proxy)["met"]


def _rec(t: float, error: str | None = None, status: int | None = 200, ttft: float = 1.0):
    return {"t_scheduled": t, "error": error, "status": status,
            "t_first": None if error else t + ttft}  # fmt: skip


def test_sent_in_window_counts_outcomes_and_tail_of_requests_sent_in_it():
    records = [
        _rec(5.0, ttft=100.0),  # before the window: ignored
        *[_rec(10.0 + i, ttft=1.0) for i in range(98)],
        _rec(50.0, ttft=9.0),
        _rec(51.0, ttft=11.0),
        _rec(52.0, "http_4xx", 429),
        _rec(53.0, "http_5xx", 503),
        _rec(54.0, "cancelled", None),
        _rec(200.0, ttft=100.0),  # at the window's end: ignored
    ]
    got = fill_any.sent_in_window({"levels": [{"window": [10.0, 200.0]}], "records": records})
    assert got["statuses"] == {"ok": 100, "429": 1, "503": 1, "cancelled": 1}
    assert got["sent"] == 103 and got["shed"] == 2
    assert got["ttft_sent_p50"] == 1.0
    assert got["ttft_sent_p99"] == pytest.approx(9.02)  # between the 99th and 100th of 100


def test_limit_trace_keeps_changes_only():
    s = [(0.0, {"a": {"limit": 8}}), (0.5, {"a": {"limit": 8}}),
         (1.0, {"a": {"limit": 16, "limit_state": {"knee": 16}}})]  # fmt: skip
    assert fill_any.limit_trace(s, ts=0.5) == {"a": [[0.0, 8, None], [2.0, 16, 16]]}


def test_backend_entries_hint_each_profiles_own_shape():
    urls = ["http://h:1", "http://h:2"]
    pp, tp = fill_any.entries(urls, ["pp4", "tp-cap24"])
    assert (pp["parallelism"], pp["pp_size"]) == ("pp", 4) and "limits" not in pp
    assert (tp["parallelism"], tp["pp_size"]) == ("tp", None)
    pp, tp = fill_any.entries(urls, ["pp4", "tp-cap24"], fixed=fill_any.PAIR_FIXED)
    assert pp["limits"] == {"algorithm": "fixed", "initial": 64}
    assert tp["limits"] == {"algorithm": "fixed", "initial": 24}


# -- profiles ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", fill_any.PROFILES)
def test_profiles_load_by_path_as_loadtest_sim_does(name):
    path = fill_any.profile_file(name)
    assert profile_path(path) == Path(path)  # a path, not a name under config/profiles
    assert plan(argparse.Namespace(profile=[path], port=[30000])) == [(path, 30000)]
    p = load_profile(path)
    assert isinstance(p, Profile) and p.name == name
    assert p.context_length >= fill_any.INPUT_LEN + fill_any.OUTPUT_LEN


def test_profile_shapes():
    shape = {n: load_profile(fill_any.profile_file(n)) for n in fill_any.PROFILES}
    assert (shape["pp4"].stages, shape["pp4"].max_running_requests) == (4, 64)
    assert (shape["pp8-cap128"].stages, shape["pp8-cap128"].max_running_requests) == (8, 128)
    assert shape["tp-cap24"].max_running_requests == 24
    assert shape["tp-cap32"].max_running_requests == 32
    for n in ("tp-kvbound", "tp-cap24", "tp-cap32"):
        assert shape[n].parallelism == "tp"
    # the pair's and open section's backends serve one model (a router may route by model)
    assert len({p.model_name for p in shape.values()}) == 1
    kv = shape["tp-kvbound"]  # the pool cannot hold max_running_requests of these requests
    assert kv.max_total_tokens / fill_any.INPUT_LEN < kv.max_running_requests


@pytest.mark.parametrize(
    ("name", "clients", "tok_s"),
    [("pp4", 96, 750), ("pp8-cap128", 128, 1500), ("tp-kvbound", 128, 1500)],
)
def test_single_profiles_deliver_their_throughput_in_the_engine_model(name, clients, tok_s):
    p = load_profile(fill_any.profile_file(name))
    r = closed_loop(p, clients, input_len=fill_any.INPUT_LEN, output_len=fill_any.OUTPUT_LEN,
                    think_s=0.002, jitter_s=0.002)  # fmt: skip
    assert r.aggregate_tok_s == pytest.approx(tok_s, rel=0.1)
    if name == "tp-kvbound":  # the KV pool, not the running cap, decides how many run
        assert r.mean_running < 0.85 * clients < p.max_running_requests
        assert r.mean_queued > 0.1 * clients
    else:  # the running cap decides
        assert r.mean_running == pytest.approx(p.max_running_requests, rel=0.05)


def test_open_capacity_is_derived_per_profile_from_the_engine_model():
    caps = fill_any.open_capacity(str(fill_any.OUTPUT_LEN))
    assert set(caps) == set(fill_any.OPEN)
    for c in caps.values():
        assert c["req_s"] == pytest.approx(c["tok_s"] / fill_any.OUTPUT_LEN)
    # tp-cap32 is the faster backend: an even split overloads pp4 first
    assert caps["tp-cap32"]["req_s"] > 1.3 * caps["pp4"]["req_s"]
    # answers drawn from a range: requests per s at their mean length
    varied = fill_any.open_capacity("uniform:96-160")
    for c in varied.values():
        assert c["req_s"] == pytest.approx(c["tok_s"] / 128)


def test_a_bad_answer_length_is_refused_before_anything_starts():
    with pytest.raises(argparse.ArgumentTypeError):
        fill_any.length_arg("bogus")
    assert fill_any.length_arg("uniform:64-192") == "uniform:64-192"


def _arm(tok: float, ttft99: float, **extra: object) -> dict:
    row = {"output_tok_s": tok, "ttft_p50": 1.0, "ttft_p99": ttft99, "completed": 10,
           "errors": {}, "sim_served": {"pp4": 5}}  # fmt: skip
    return {**row, **extra}


def test_report_judges_every_section_and_names_the_command():
    proxied = {
        "limits": {"pp4": 64},
        "knees": {"pp4": 64},
        "limit_trace": {"pp4": [[0.0, 8, None]]},
    }
    single = {p: {"direct": _arm(1000, 2.0), "proxy": _arm(960, 2.0, **proxied)}
              for p, _ in fill_any.SINGLE}  # fmt: skip
    single["pp4"]["proxy"]["output_tok_s"] = 700  # one profile misses: the section is not met
    pair = {"router": _arm(1000, 6.0), "proxy": _arm(1150, 3.0, **proxied),
            "fixed": _arm(1190, 5.6, **proxied)}  # fmt: skip
    opened = {"statuses": {"ok": 9, "429": 1}, "sent": 10, "ttft_sent_p50": 1.0}
    open_ = {"router": _arm(1600, 30.0, request_throughput=13.0, shed=0,
                            **{**opened, "ttft_sent_p99": 34.0}),
             "proxy": _arm(1700, 5.0, request_throughput=14.0, shed=1,
                           **{**opened, "ttft_sent_p99": 6.0}, **proxied)}  # fmt: skip
    args = argparse.Namespace(command="python benchmarks/fill_any.py --out", time_scale=1.0,
                              warmup=5.0, duration=25.0, overload=1.1, queue_length=64,
                              deadline=5.0, drain=90.0, output_len="128",
                              no_hints=False)  # fmt: skip
    caps = {"pp4": {"tok_s": 768.0, "req_s": 6.0}, "tp-cap32": {"tok_s": 1152.0, "req_s": 9.0}}
    rounds = [{"single": single, "pair": pair, "open": open_}]
    text, data = fill_any.report(args, rounds, caps, 16.5, 400.0)
    assert "Command: `python benchmarks/fill_any.py --out`" in text
    assert text.splitlines()[-1] == "Verdicts: single NOT met, pair met, open met."
    assert not data["verdicts"]["single"]["pp4"]["met"]
    assert data["verdicts"]["single"]["tp-kvbound"]["met"]
    assert data["verdicts"]["pair"]["adaptive"]["tok_s"] == pytest.approx(1.15)
    assert data["verdicts"]["open"]["ttft_p99"] == pytest.approx(6 / 34)


def test_backends_listed_without_hints_carry_only_their_url():
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    hinted = fill_any.entries(urls, ["pp4", "tp-cap24"])
    assert (hinted[0]["parallelism"], hinted[0]["pp_size"]) == ("pp", 4)
    bare = fill_any.entries(urls, ["pp4", "tp-cap24"], hints=False)
    assert [set(e) for e in bare] == [{"name", "url"}] * 2
