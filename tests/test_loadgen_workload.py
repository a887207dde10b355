"""Workload: length distributions, synthetic prompts, datasets, payload shapes, self-checks."""

from __future__ import annotations

import random

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadtest.records import RequestRecord
from loadtest.selfcheck import build_selfcheck, percentile
from loadtest.workload import (
    WORDS,
    LengthDist,
    Workload,
    WorkloadConfig,
    build_payload,
    load_dataset,
)


@pytest.mark.parametrize(
    ("text", "kind", "lo", "hi"),
    [("512", "fixed", 512, 512), ("uniform:256-768", "uniform", 256, 768),
     ("normal:512,64", "normal", 256, 768), ("fixed:7", "fixed", 7, 7)],
)  # fmt: skip
def test_length_distributions_sample_within_their_bounds(text, kind, lo, hi):
    dist = LengthDist.parse(text)
    assert dist.kind == kind
    rng = random.Random(1)
    xs = [dist.sample(rng) for _ in range(2000)]
    assert lo <= min(xs) and max(xs) <= hi
    assert dist.describe() == text.removeprefix("fixed:")


@pytest.mark.parametrize("bad", ["", "abc", "0", "uniform:9-3", "normal:5", "normal:-1,2"])
def test_bad_lengths_are_rejected(bad):
    with pytest.raises(ValueError, match="bad length"):
        LengthDist.parse(bad)


def test_words_are_distinct_single_words():
    assert len(set(WORDS)) == len(WORDS) >= 256
    assert all(w.isalpha() and w.islower() for w in WORDS)


@given(n=st.integers(min_value=1, max_value=3000), i=st.integers(min_value=0, max_value=10**6))
def test_synthetic_prompt_has_exactly_the_requested_words(n, i):
    w = Workload(WorkloadConfig(input_len=LengthDist("fixed", n)))
    spec = w.spec(i)
    body = orjson.loads(spec.body)
    assert len(body["messages"][0]["content"].split()) == n == spec.input_len


def test_prompts_are_unique_unless_a_prefix_is_shared():
    w = Workload(WorkloadConfig(input_len=LengthDist("fixed", 6)))
    firsts = {tuple(orjson.loads(w.spec(i).body)["messages"][0]["content"].split()[:4])
              for i in range(5000)}  # fmt: skip
    assert len(firsts) == 5000  # the 4-word salt alone tells any two prompts apart
    shared = Workload(WorkloadConfig(input_len=LengthDist("fixed", 40), shared_prefix=32))
    texts = [orjson.loads(shared.spec(i).body)["messages"][0]["content"].split() for i in range(50)]
    assert len({tuple(t[:32]) for t in texts}) == 1
    assert len({tuple(t) for t in texts}) == 50


def test_same_seed_same_payloads_other_seed_different():
    def bodies(seed):
        w = Workload(WorkloadConfig(seed=seed, input_len=LengthDist.parse("uniform:5-50"),
                                    output_len=LengthDist.parse("normal:100,20")))  # fmt: skip
        return [w.next().body for _ in range(20)]

    assert bodies(3) == bodies(3)
    assert bodies(3) != bodies(4)


def test_processes_split_one_sequence():
    cfg = WorkloadConfig(input_len=LengthDist("fixed", 8))
    whole = [Workload(cfg).next().body for _ in range(1)]
    a = Workload(cfg, start=0, step=2)
    b = Workload(cfg, start=1, step=2)
    one = Workload(cfg)
    seq = [one.next().body for _ in range(6)]
    assert [a.next().body for _ in range(3)] == seq[0::2]
    assert [b.next().body for _ in range(3)] == seq[1::2]
    assert whole[0] == seq[0]


@pytest.mark.parametrize("api", ["chat", "completions", "generate"])
def test_payload_shapes(api):
    kwargs = dict(model="m", messages=[{"role": "user", "content": "hi"}], text="hi",
                  max_tokens=9, ignore_eos=True)  # fmt: skip
    streamed = build_payload(api, stream=True, **kwargs)
    whole = build_payload(api, stream=False, **kwargs)
    if api == "generate":
        sampling = {"max_new_tokens": 9, "ignore_eos": True}
        assert streamed == {"text": "hi", "stream": True, "sampling_params": sampling}
    else:
        assert streamed["max_tokens"] == 9 and streamed["ignore_eos"] is True
        assert streamed["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert "stream_options" not in whole
        assert ("messages" in streamed) == (api == "chat")
        assert ("prompt" in streamed) == (api == "completions")
    no_eos = build_payload(api, stream=True, **{**kwargs, "ignore_eos": False})
    assert "ignore_eos" not in no_eos or no_eos.get("ignore_eos") is False
    assert no_eos.get("sampling_params", {}).get("ignore_eos", False) is False


def test_sharegpt_json_and_jsonl(tmp_path):
    share = tmp_path / "sg.json"
    share.write_bytes(orjson.dumps([
        {"conversations": [{"from": "system", "value": "be nice"},
                           {"from": "human", "value": "What is 2+2?"},
                           {"from": "gpt", "value": "4"}, {"from": "human", "value": "again"}]},
        {"conversations": [{"from": "gpt", "value": "only a reply"}]},
    ]))  # fmt: skip
    prompts = load_dataset(share)
    assert len(prompts) == 1
    assert prompts[0].messages == (("system", "be nice"), ("user", "What is 2+2?"))
    jl = tmp_path / "p.jsonl"
    jl.write_bytes(b'{"prompt": "hello there", "max_tokens": 12}\n\n"bare string"\n'
                   b'{"messages": [{"role": "user", "content": "hey"}]}\n')  # fmt: skip
    prompts = load_dataset(jl)
    assert [p.text for p in prompts] == ["hello there", "bare string", "hey"]
    assert prompts[0].output_len == 12
    # a dataset turns ignore_eos off unless asked, and uses the file's hint for max_tokens
    w = Workload(WorkloadConfig(dataset=prompts, output_len_given=False))
    bodies = [orjson.loads(w.spec(i).body) for i in range(3)]
    assert all("ignore_eos" not in b for b in bodies)
    assert sorted(b["max_tokens"] for b in bodies) == [12, 512, 512]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "x"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2"):
        load_dataset(bad)


def _rec(**kw) -> RequestRecord:
    base = dict(level=2, worker=0, t_scheduled=0.0, t_send=0.0, t_end=1.0,
                requested_output_len=4, completion_tokens=4, token_counts=[1, 1, 1, 1],
                token_times=[0.1, 0.2, 0.3, 0.4])  # fmt: skip
    return RequestRecord(**{**base, **kw})


def test_selfcheck_flags_mismatch_early_stops_errors_and_a_slow_client():
    records = [
        _rec(),
        _rec(worker=1, completion_tokens=5),  # usage says 5, chunks say 4
        _rec(worker=0, t_send=1.0, t_end=2.0, completion_tokens=2, token_counts=[1, 1],
             token_times=[1.1, 1.2]),  # early stop
        _rec(worker=1, t_send=1.0, t_end=1.5, error="http_5xx"),
    ]  # fmt: skip
    check = build_selfcheck(records, requested_concurrency=2, dispatch_delays=[0.0001, 0.01],
                            loop_lag=[0.0], cpu_fraction=0.2, window=(0.0, 2.0),
                            ignore_eos=True)  # fmt: skip
    assert check["usage_chunk_mismatch_requests"] == 1
    assert check["early_stops"] == 1
    assert check["errors"] == {"http_5xx": 1}
    assert check["achieved_concurrency"] == pytest.approx(1.75)
    assert check["client_bound"]  # dispatch p99 ~10 ms
    text = " ".join(check["warnings"])
    assert "CLIENT IS THE BOTTLENECK" in text and "achieved concurrency" in text
    assert "usage differs" in text and "ignore_eos" in text and "error rate 25.0%" in text
    calm = build_selfcheck(records[:1], requested_concurrency=1, dispatch_delays=[1e-4],
                           loop_lag=[1e-4], cpu_fraction=0.1, window=(0.0, 1.0),
                           ignore_eos=True)  # fmt: skip
    assert calm["warnings"] == [] and not calm["client_bound"]


def test_percentile_matches_numpy_linear():
    import numpy as np

    rng = random.Random(5)
    xs = [rng.random() for _ in range(101)]
    for q in (0, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_requests_the_run_cancelled_itself_are_not_errors():
    """--drain-timeout or Ctrl-C cancelled them: counted apart, outside the error rate."""
    records = [_rec(), _rec(worker=1), _rec(worker=0, t_send=1.0, t_end=1.5, error="cancelled")]
    check = build_selfcheck(records, requested_concurrency=2, dispatch_delays=[1e-4],
                            loop_lag=[1e-4], cpu_fraction=0.1, window=(0.0, 2.0),
                            ignore_eos=True)  # fmt: skip
    assert check["errors"] == {} and check["error_rate"] == 0.0 and check["cancelled"] == 1
    assert not any(w.startswith("error rate") for w in check["warnings"])
    assert any(w.startswith("1 request(s) cancelled by the run itself") for w in check["warnings"])
    records.append(_rec(worker=1, t_send=1.0, t_end=1.5, error="http_5xx"))
    check = build_selfcheck(records, requested_concurrency=2, dispatch_delays=[1e-4],
                            loop_lag=[1e-4], cpu_fraction=0.1, window=(0.0, 2.0),
                            ignore_eos=True)  # fmt: skip
    assert check["error_rate"] == pytest.approx(1 / 3)  # of the 3 the target answered
