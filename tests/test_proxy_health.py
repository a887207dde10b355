"""Backend state machine: passive ejection, half-open probe, pool add/drain/remove."""

from __future__ import annotations

import time

from proxy.backends import BackendPool, State
from proxy.health import Health
from proxy.metrics import Metrics
from proxy.settings import BackendSettings, HealthSettings


class _Limit:
    limit = 4


def _setup(**health):
    pool = BackendPool(lambda _b: _Limit())
    changes: list = []
    pool.listeners.append(changes.append)
    h = Health(pool, HealthSettings(**health), session=None, metrics=Metrics(pool.all))  # type: ignore[arg-type]
    b = pool.add(BackendSettings(url="http://h:1"))
    return pool, h, b, changes


async def test_passive_ejection_and_half_open_probe():
    _pool, h, b, changes = _setup(passive_failures=2, eject_s=10)
    assert b.state is State.PROBING and b.routable
    b.in_flight = 1
    assert not b.routable  # half-open: one request at a time
    b.in_flight = 0
    h.record_success(b)
    assert b.state is State.HEALTHY
    h.record_failure(b, "connect")
    assert b.state is State.HEALTHY  # one failure is not enough
    h.record_success(b)
    h.record_failure(b, "connect")
    assert b.state is State.HEALTHY  # the success reset the count
    h.record_failure(b, "connect")
    assert b.state is State.UNHEALTHY and not b.routable
    assert b.ejected_until > time.monotonic() + 9
    # after the ejection the backend is probed; a failing probe ejects it for twice as long
    b.set_state(State.PROBING)
    h.record_failure(b, "http_503")
    assert b.state is State.UNHEALTHY
    assert b.ejected_until > time.monotonic() + 19
    b.set_state(State.PROBING)
    h.record_success(b)
    assert b.state is State.HEALTHY and b.ejections == 0
    assert changes  # admission is woken on every change


async def test_pool_remove_keeps_a_busy_backend_until_idle():
    pool, _h, b, _ = _setup()
    b.in_flight = 2
    pool.remove(b.name)
    assert b.name not in pool and b in pool.all() and b.state is State.DRAINING
    pool.add(BackendSettings(url="http://h:1"))  # the name is free again at once
    b.in_flight = 0
    pool.reap(b)
    assert b not in pool.all() and len(pool.all()) == 1
    new = pool.all()[0]
    pool.drain(new.name)
    assert not new.routable
    pool.undrain(new.name)
    assert new.state is State.PROBING
