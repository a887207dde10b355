"""/metrics says what /admin says: the limit's phase and last decision per backend; scraped
SGLang gauges that went stale are flagged and not exported as if current."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import Proxy
from proxy.settings import load_settings


def _proxy() -> Proxy:
    return Proxy(load_settings(None, environ={}, backends=[{"url": "http://h:1", "name": "b"}]))


def _samples(proxy: Proxy, name: str) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(proxy.metrics.render().decode()):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_the_limit_phase_and_last_decision_are_labels_matching_admin():
    proxy = _proxy()
    (b,) = proxy.pool.all()
    state = b.describe()["limit_state"]
    decision = _samples(proxy, "pipefill_backend_limit_decision")
    phase = _samples(proxy, "pipefill_backend_limit_phase")
    assert decision == {(("backend", "b"), ("code", state["decision"])): 1.0}
    assert phase == {(("backend", "b"), ("phase", state["phase"])): 1.0}
    assert _samples(proxy, "pipefill_backend_knee") == (
        {} if state["knee"] is None else {(("backend", "b"),): state["knee"]}
    )


def test_stale_scraped_values_are_flagged_and_not_exported():
    proxy = _proxy()
    (b,) = proxy.pool.all()
    st = b.stats
    st.stale_after_s = 5.0
    now = time.monotonic()
    st.observe_scrape(ok=True, queue_reqs=3.0, running_reqs=8.0, token_usage=0.5, now=now)
    key = (("backend", "b"),)
    assert _samples(proxy, "pipefill_backend_scraped_queue_reqs") == {key: 3.0}
    assert _samples(proxy, "pipefill_backend_scrape_stale") == {key: 0.0}
    # later scrapes fail: the last values age past stale_after_s
    st.observe_scrape(ok=False, error="timeout", now=now)
    st.scrape.ok_at = now - 60
    assert _samples(proxy, "pipefill_backend_scrape_stale") == {key: 1.0}
    for name in ("queue_reqs", "running_reqs", "token_usage"):
        assert _samples(proxy, f"pipefill_backend_scraped_{name}") == {}, name


def test_the_itl_histogram_exposes_cumulative_buckets_sum_and_count():
    from prometheus_client import generate_latest

    from proxy.metrics import ITL_BUCKETS, Metrics

    m = Metrics(lambda: [])
    h = m.itl.labels("b0")
    assert m.itl.labels("b0") is h  # one child per backend, as the hot path caches it
    for v in (0.0005, 0.02, 0.02, 3.0):  # 0.02 is a bound: le is inclusive
        h.observe(v)
    fam = next(
        f
        for f in text_string_to_metric_families(generate_latest(m.registry).decode())
        if f.name == "pipefill_itl_seconds"
    )
    assert fam.type == "histogram"
    got = {(s.name, s.labels.get("le")): s.value for s in fam.samples}
    assert got[("pipefill_itl_seconds_bucket", "0.001")] == 1
    assert got[("pipefill_itl_seconds_bucket", "0.01")] == 1
    assert got[("pipefill_itl_seconds_bucket", "0.02")] == 3
    assert got[("pipefill_itl_seconds_bucket", str(ITL_BUCKETS[-1]))] == 3
    assert got[("pipefill_itl_seconds_bucket", "1.0")] == 3  # le as prometheus-client writes 1
    assert got[("pipefill_itl_seconds_bucket", "+Inf")] == 4
    assert got[("pipefill_itl_seconds_count", None)] == 4
    assert got[("pipefill_itl_seconds_sum", None)] == pytest.approx(3.0405)
