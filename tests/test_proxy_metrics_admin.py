"""/metrics says what /admin says: the limit's phase and last decision per backend; scraped
SGLang gauges that went stale are flagged and not exported as if current."""

from __future__ import annotations

import time

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
