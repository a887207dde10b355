"""The proxy's queue: late binding, priorities, bounds, deadlines, client-gone, wake()."""

from __future__ import annotations

import asyncio

import pytest
from adapt_fakes import FakeBackend, FakeClock

from proxy.admission import Admission, NoHealthyBackend, QueueBytesFull, QueueFull, QueueTimeout
from proxy.limits import LimitSettings
from proxy.policies import make_policy


def admission(backends, **kw) -> Admission:
    kw.setdefault("max_queue", 100)
    kw.setdefault("queue_deadline_s", 30.0)
    return Admission(backends, make_policy(kw.pop("policy", "least_in_flight")), **kw)


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_binds_at_once_and_release_is_idempotent():
    a = FakeBackend("a", 2)
    adm = admission([a])
    lease = await adm.acquire()
    assert lease.backend is a and a.in_flight == 1 and lease.waited_s == 0.0
    lease.release()
    lease.release()
    assert a.in_flight == 0
    with await adm.acquire() as lease2:
        assert a.in_flight == 1
    assert a.in_flight == 0 and lease2.released


async def test_late_binding_goes_to_whichever_backend_frees_first():
    a, b = FakeBackend("a", 1), FakeBackend("b", 1)
    adm = admission([a, b])
    la, lb = await adm.acquire(), await adm.acquire()
    assert {la.backend.name, lb.backend.name} == {"a", "b"}
    waiter = asyncio.create_task(adm.acquire())
    await settle()
    assert adm.depth == 1 and not waiter.done()
    lb.release()  # b frees first: the queued request is bound to b now, not at arrival
    lease = await waiter
    assert lease.backend is lb.backend and lease.waited_s >= 0
    assert adm.depth == 0


async def test_a_burst_never_exceeds_limits():
    backends = [FakeBackend(n, 4) for n in "abc"]
    adm = admission(backends)
    tasks = [asyncio.create_task(adm.acquire()) for _ in range(50)]
    await settle()
    done = [t for t in tasks if t.done()]
    assert len(done) == 12 and all(b.in_flight == 4 for b in backends)
    assert adm.depth == 38
    for t in done:
        t.result().release()
    await settle()
    assert sum(t.done() for t in tasks) == 24
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_cold_limit_takes_a_burst_as_it_queues_not_at_the_next_tick():
    """Nothing known of the backend: sending what waits is what sending straight would do, so
    requests queued above its first limit are bound as they arrive (the limit grows), with no
    release and no control tick in between. A fixed limit holds them."""
    from proxy.limits import AdaptiveLimit

    clock = FakeClock()
    cold = FakeBackend("a", clock=clock, limit_obj=AdaptiveLimit(LimitSettings(), floor=8))
    adm = admission([cold], clock=clock)
    tasks = [asyncio.create_task(adm.acquire()) for _ in range(40)]
    await settle()
    assert all(t.done() for t in tasks) and cold.in_flight == 40 and adm.depth == 0
    assert cold.limit.limit >= 40 and cold.limit.decision.code.value == "grow"

    fixed = FakeBackend("b", 8)
    adm = admission([fixed], clock=clock)
    tasks += [asyncio.create_task(adm.acquire()) for _ in range(40)]
    await settle()
    assert fixed.in_flight == 8 and adm.depth == 32
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_interactive_goes_before_batch_and_fifo_within_class():
    a = FakeBackend("a", 1)
    adm = admission([a])
    first = await adm.acquire()
    order: list[str] = []

    async def wait(name, priority):
        lease = await adm.acquire(priority=priority)
        order.append(name)
        return lease

    tasks = [
        asyncio.create_task(wait("batch1", "batch")),
        asyncio.create_task(wait("batch2", "batch")),
        asyncio.create_task(wait("inter1", "interactive")),
        asyncio.create_task(wait("inter2", "interactive")),
    ]
    await settle()
    assert adm.depth_by_class() == {"interactive": 2, "batch": 2}
    lease = first
    for _ in range(4):
        lease.release()
        await settle()
        lease = next(t.result() for t in tasks if t.done() and not t.result().released)
    assert order == ["inter1", "inter2", "batch1", "batch2"]
    lease.release()
    # A new interactive request does not overtake queued interactive ones either.
    assert not adm._ahead("batch") and not adm._ahead("interactive")


async def test_queue_full_is_a_counted_429_with_retry_after():
    a = FakeBackend("a", 1)
    adm = admission([a], max_queue=2)
    await adm.acquire()
    waiters = [asyncio.create_task(adm.acquire()) for _ in range(2)]
    await settle()
    with pytest.raises(QueueFull) as e:
        await adm.acquire()
    assert e.value.retry_after >= 1
    assert adm.rejections["queue_full"] == 1
    for t in waiters:
        t.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)


async def test_queue_deadline_is_a_counted_timeout():
    a = FakeBackend("a", 1)
    adm = admission([a], queue_deadline_s=30.0)
    await adm.acquire()
    with pytest.raises(QueueTimeout):
        await adm.acquire(deadline=0.01)  # a per-request deadline overrides the default
    assert adm.rejections["queue_timeout"] == 1 and adm.depth == 0


async def test_client_gone_leaves_the_queue_at_once():
    a = FakeBackend("a", 1)
    adm = admission([a])
    lease = await adm.acquire()
    waiter = asyncio.create_task(adm.acquire())
    await settle()
    assert adm.depth == 1
    waiter.cancel()
    await settle()
    assert adm.depth == 0 and adm.rejections["client_gone"] == 1
    lease.release()
    assert a.in_flight == 0  # nobody was bound to the departed client


async def test_bound_then_cancelled_gives_the_slot_back():
    a = FakeBackend("a", 1)
    adm = admission([a])
    lease = await adm.acquire()
    waiter = asyncio.create_task(adm.acquire())
    await settle()
    lease.release()  # binds the waiter synchronously (a.in_flight == 1 again) ...
    assert a.in_flight == 1
    waiter.cancel()  # ... but its client leaves before the task resumes
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert a.in_flight == 0


async def test_no_healthy_backend():
    a, b = FakeBackend("a", 1), FakeBackend("b", 1)
    a.routable = b.routable = False
    adm = admission([a, b])
    with pytest.raises(NoHealthyBackend):
        await adm.acquire()
    b.routable = True
    with pytest.raises(NoHealthyBackend):
        await adm.acquire(exclude={"b"})  # a retry that excluded the only healthy one
    lease = await adm.acquire(exclude={"a"})
    assert lease.backend is b
    # A queued request fails as soon as its last usable backend goes away.
    waiter = asyncio.create_task(adm.acquire())
    await settle()
    b.routable = False
    adm.wake()
    with pytest.raises(NoHealthyBackend):
        await waiter
    assert adm.rejections["no_healthy_backend"] == 3


async def test_retry_excludes_the_failed_backend_and_skips_past_a_blocked_waiter():
    a, b = FakeBackend("a", 1), FakeBackend("b", 1)
    adm = admission([a, b])
    la, lb = await adm.acquire(), await adm.acquire()
    only_b = asyncio.create_task(adm.acquire(exclude={la.backend.name}))
    anyone = asyncio.create_task(adm.acquire())
    await settle()
    la.release()  # the head waiter may not use this backend; the next one takes it
    await settle()
    assert not only_b.done() and anyone.done()
    assert anyone.result().backend is la.backend
    lb.release()
    await settle()
    assert only_b.result().backend is lb.backend


async def test_wake_hands_out_slots_after_a_limit_grows():
    a = FakeBackend("a", 1)
    adm = admission([a])
    await adm.acquire()
    waiter = asyncio.create_task(adm.acquire())
    await settle()
    a.limit._limit = 2
    adm.wake()
    await settle()
    assert waiter.done() and a.in_flight == 2


async def test_a_backend_whose_last_request_failed_gets_one_probe_request():
    failing = FakeBackend("failing", 8)
    failing.stats.observe_completion(False, "disconnect", 0.001)
    adm = admission([failing], probe_in_flight=1)
    await adm.acquire()
    waiter = asyncio.create_task(adm.acquire())
    await settle()
    assert not waiter.done()
    failing.stats.observe_completion(True, None, 0.001)  # it answered again: trusted
    adm.wake()
    await settle()
    assert waiter.done() and failing.in_flight == 2


async def test_a_new_backend_gets_its_whole_limit_before_its_first_answer():
    """It passed its health checks to be routable; a long first prefill must not hold it to
    one request while the queue piles onto another backend."""
    new = FakeBackend("new", 8, trusted=False)
    adm = admission([new], probe_in_flight=1)
    for _ in range(8):
        await asyncio.wait_for(adm.acquire(), 1.0)
    assert new.in_flight == 8


class RecordingLimit:
    settings = LimitSettings()

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.knee = None
        self.windows = []

    def update(self, window) -> None:
        self.windows.append(window)
        self.limit += 1


async def test_limits_are_fed_complete_windows():
    clock = FakeClock()
    lim = RecordingLimit(2)
    a = FakeBackend("a", clock=clock, limit_obj=lim)
    adm = admission([a], clock=clock)
    l1 = await adm.acquire()
    l2 = await adm.acquire()
    clock.advance(0.5)
    l1.release()  # window (1 s) not complete: nothing fed
    assert lim.windows == []
    clock.advance(0.6)
    a.stats.observe_tokens(50)
    l2.release()
    assert len(lim.windows) == 1
    w = lim.windows[0]
    assert w.duration == pytest.approx(1.1) and w.tokens == 50
    # in flight 2 for 0.5 s, then 1 for 0.6 s
    assert w.in_flight == pytest.approx((2 * 0.5 + 1 * 0.6) / 1.1)
    assert w.at_limit == pytest.approx(0.5 / 1.1)
    assert w.limit == 2 and lim.limit == 3
    # the window after a change settles (not fed); the one after it integrates the new limit
    clock.advance(0.1)
    l3 = await adm.acquire()
    assert len(lim.windows) == 1
    clock.advance(1.0)
    l3.release()
    assert len(lim.windows) == 2 and lim.windows[-1].limit == 3


async def test_control_loop_runs_and_stops():
    a = FakeBackend("a", 1)
    adm = admission([a], control_interval_s=0.01)
    task = adm.start()
    assert adm.start() is task
    await asyncio.sleep(0.03)
    await adm.close()
    assert task.done()


async def test_snapshot_reports_depth_waits_and_rejections():
    a = FakeBackend("a", 1)
    adm = admission([a])
    seen = []
    adm.on_wait = lambda p, w, outcome: seen.append((p, outcome))
    lease = await adm.acquire()
    waiter = asyncio.create_task(adm.acquire(priority="batch"))
    await settle()
    snap = adm.snapshot()
    assert snap["depth"] == 1 and snap["classes"]["batch"]["depth"] == 1
    lease.release()
    await waiter
    snap = adm.snapshot()
    assert snap["classes"]["batch"]["admitted"] == 1 and snap["classes"]["batch"]["queued"] == 1
    assert snap["classes"]["batch"]["wait_s_p50"] is not None
    assert seen == [("batch", "admitted")]
    assert set(snap["rejections"]) >= {
        "queue_full",
        "queue_timeout",
        "no_healthy_backend",
        "client_gone",
    }


async def test_works_with_the_proxys_backend_pool():
    from proxy.backends import BackendPool, State, default_limit_factory
    from proxy.limits import LimitSettings
    from proxy.settings import BackendSettings

    limits = LimitSettings()
    pool = BackendPool(lambda b: default_limit_factory(limits, b))
    pp = pool.add(BackendSettings(name="pp", url="http://127.0.0.1:1", parallelism="pp", pp_size=8))
    tp = pool.add(BackendSettings(name="tp", url="http://127.0.0.1:2", parallelism="tp"))
    for b in (pp, tp):
        b.set_state(State.HEALTHY)
        b.stats.observe_first_byte()
    assert pp.limit.limit == 8 and pp.limit.floor == 8
    adm = Admission(pool, make_policy("least_in_flight"), max_queue=10, queue_deadline_s=5)
    leases = [await adm.acquire() for _ in range(16)]
    assert pp.in_flight == 8 and tp.in_flight == 8
    pool.drain("tp")
    adm.wake()
    waiter = asyncio.create_task(adm.acquire())
    await settle()
    for lease in leases:
        if lease.backend is tp:
            lease.release()
    await settle()
    # the draining backend takes nothing new, though it has room: the waiter goes to pp, whose
    # limit (a cold start, nothing known) takes the demand
    assert tp.in_flight == 0
    assert (await asyncio.wait_for(waiter, 1.0)).backend is pp and pp.limit.limit > 8


class StaticRecordingLimit(RecordingLimit):
    def update(self, window) -> None:
        self.windows.append(window)


async def test_windows_report_pressure_only_while_requests_wait():
    """A backend at its limit is under pressure only while the proxy's queue holds waiters:
    that (not merely being at the limit) tells the limit that demand exceeds it."""
    clock = FakeClock()
    lim = StaticRecordingLimit(1)
    a = FakeBackend("a", clock=clock, limit_obj=lim)
    adm = admission([a], clock=clock)
    first = await adm.acquire()
    clock.advance(0.4)  # at the limit, nobody waiting
    waiter = asyncio.create_task(adm.acquire())
    await settle()
    assert adm.depth == 1
    clock.advance(0.6)  # at the limit with a waiter
    first.release()  # closes the 1 s window and hands the slot to the waiter
    second = await waiter
    w = lim.windows[0]
    assert w.at_limit == pytest.approx(1.0)
    assert w.pressure == pytest.approx(0.6)
    clock.advance(1.0)  # at the limit again, queue empty
    second.release()
    assert lim.windows[1].at_limit == pytest.approx(1.0) and lim.windows[1].pressure == 0.0


async def test_each_backend_is_told_its_share_of_the_queue_split_by_limits():
    """Shares of the waiting requests follow the limits and add up to (about) the queue: a limit
    climbing under a backlog sizes its step from its share (proxy/limits.py)."""
    clock = FakeClock()
    a = FakeBackend("a", 1, clock=clock)
    b = FakeBackend("b", 3, clock=clock)
    adm = admission([a, b], clock=clock)
    leases = [await adm.acquire() for _ in range(4)]
    waiters = [asyncio.create_task(adm.acquire()) for _ in range(8)]
    await settle()
    assert adm.depth == 8
    clock.advance(1.0)
    assert a.stats.take_window().backlog == 2 and b.stats.take_window().backlog == 6
    for w in waiters:
        w.cancel()
    await settle()
    assert a.stats.take_window().backlog == 0
    for lease in leases:
        lease.release()


async def test_queued_request_bytes_are_capped_and_released_however_a_waiter_leaves():
    a = FakeBackend("a", 1)
    adm = admission([a], max_queued_bytes=1000)
    lease = await adm.acquire(size=10**6)  # bound at once: its bytes are not queued
    assert adm.queued_bytes == 0
    first = asyncio.create_task(adm.acquire(size=600))
    await settle()
    assert adm.queued_bytes == 600
    with pytest.raises(QueueBytesFull) as e:  # 600 + 500 > 1000: refused, not queued
        await adm.acquire(size=500)
    assert isinstance(e.value, QueueFull) and e.value.retry_after >= 1
    assert adm.rejections["queue_bytes_full"] == 1 and adm.depth == 1
    second = asyncio.create_task(adm.acquire(size=400))  # 600 + 400 fits
    await settle()
    assert adm.queued_bytes == 1000 and adm.snapshot()["queued_bytes"] == 1000
    # a recalled request (front) is never refused, but its bytes count
    recalled = asyncio.create_task(adm.acquire(size=300, front=True))
    await settle()
    assert adm.queued_bytes == 1300
    # leaving: admitted ...
    lease.release()
    (await recalled).release()
    held = await first
    assert adm.queued_bytes == 400
    # ... the client gone ...
    second.cancel()
    await asyncio.gather(second, return_exceptions=True)
    assert adm.queued_bytes == 0
    # ... timed out
    with pytest.raises(QueueTimeout):
        await adm.acquire(size=700, deadline=0.01)
    assert adm.queued_bytes == 0
    held.release()
    # 0: no cap
    adm.max_queued_bytes = 0
    held = await adm.acquire()
    big = asyncio.create_task(adm.acquire(size=10**9))
    await settle()
    assert adm.queued_bytes == 10**9
    big.cancel()
    await asyncio.gather(big, return_exceptions=True)
    held.release()
    assert adm.queued_bytes == 0 and adm.rejections["queue_bytes_full"] == 1


async def test_a_batch_takes_one_slot_per_sequence_and_keeps_its_place():
    a = FakeBackend("a", 4)
    adm = admission([a])
    one = await adm.acquire()
    batch = asyncio.create_task(adm.acquire(seqs=4))
    await settle()
    assert not batch.done() and a.in_flight == 1  # 4 sequences do not fit beside 1
    single = asyncio.create_task(adm.acquire())
    await settle()
    assert not single.done() and adm.depth == 2  # 3 slots free, but the batch is first
    one.release()
    lease = await batch
    assert lease.slots == 4 and a.in_flight == 4 and not single.done()
    lease.release()
    assert (await single).backend is a and a.in_flight == 1


async def test_a_batch_larger_than_the_limit_takes_an_idle_backend_whole():
    a = FakeBackend("a", 4)
    adm = admission([a])
    lease = await adm.acquire(seqs=10)
    assert lease.slots == 4 and a.in_flight == 4  # never above the limit
    lease.release()
    assert a.in_flight == 0
