"""The adaptive limit in front of the simulator's engine model, in virtual time.

Closed-loop clients go through the proxy's queue into one simulated backend (tests/limit_sim.py);
no sockets, no wall clock: each run takes a fraction of a second. Throughput ratios here are
between runs of a deterministic model, not timings of this machine.
"""

from __future__ import annotations

import pytest
from limit_sim import closed_loop_through_limit

from loadtest.sim.shapes import generate_shape
from proxy.limits import LimitSettings, make_limit

OUT = (256, 768)  # varied output lengths, so closed-loop clients do not finish in lockstep


def adaptive(profile: str):
    return make_limit(LimitSettings(), parallelism=profile[:2], pp_size=8)


def fixed(n: int):
    return make_limit(LimitSettings(algorithm="fixed", initial=n))


def test_pp8_fills_its_pipeline_within_30_simulated_seconds():
    lim = adaptive("pp8")
    run = closed_loop_through_limit("pp8", 64, lim, duration_s=150, output_len=OUT)
    assert min(lim_ for _, lim_, _, _ in run.limit_trace) >= 8  # the pp floor
    reached = run.first_time_at(56)
    assert reached is not None and reached <= 30
    best = closed_loop_through_limit("pp8", 64, fixed(64), duration_s=150, output_len=OUT)
    assert run.throughput(60, 150) >= 0.95 * best.throughput(60, 150)
    assert run.ttft_pct(60, 150, 0.99) <= 1.2 * best.ttft_pct(60, 150, 0.99) + 0.05


@pytest.mark.parametrize(("word", "gauges"), [(True, "none"), (False, "none"), (True, "loads")])
def test_pp8_fills_on_what_the_proxy_sees_alone(word, gauges):
    """SGLang without --enable-metrics (its default) has no gauges, only its load report (and
    an older one not even that); a server that is not SGLang may not say what it runs either.
    The limit then has its own requests waiting for a first token to go on, and must still
    fill the pipeline."""
    lim = adaptive("pp8")
    run = closed_loop_through_limit(
        "pp8", 64, lim, duration_s=150, output_len=OUT, word=word, gauges=gauges
    )
    assert ("server" in {d.code.value for d in lim.history}) == word  # the word, if heard
    reached = run.first_time_at(56)
    assert reached is not None and reached <= 30
    best = closed_loop_through_limit("pp8", 64, fixed(64), duration_s=150, output_len=OUT)
    assert run.throughput(60, 150) >= 0.95 * best.throughput(60, 150)


@pytest.mark.parametrize(
    ("profile", "clients", "levels"),
    [
        ("pp8", 128, (32, 64, 96)),
        ("tp8", 48, (16, 32, 48)),
    ],
)
def test_close_to_the_best_fixed_limit(profile, clients, levels):
    lim = adaptive(profile)
    run = closed_loop_through_limit(profile, clients, lim, duration_s=150, output_len=OUT)
    fixed_runs = {
        n: closed_loop_through_limit(profile, clients, fixed(n), duration_s=150, output_len=OUT)
        for n in levels
    }
    best = max(fixed_runs.values(), key=lambda r: r.throughput(60, 150))
    assert run.throughput(60, 150) >= 0.93 * best.throughput(60, 150)
    assert run.ttft_pct(60, 150, 0.99) <= 1.25 * best.ttft_pct(60, 150, 0.99) + 0.05


@pytest.mark.parametrize("seed", [1, 150])  # prefill-bound shapes of the tune split
def test_clients_arriving_after_the_servers_word_are_judged_as_if_they_came_with_it(seed):
    """A real proxy reads the server's max_running_requests when it starts, before any client
    comes; their surge then queues for prefill behind itself, which is not a queue the limit
    should cut for. With the clients 2 s after the word, the limit decides what it decides with
    them arriving together with it (where the word's own settling window covers their wave):
    the same decisions, as late after the clients' arrival (within a window)."""
    shape = generate_shape(seed)
    clients = 2 * shape.est.capacity

    def decisions(at: float) -> list[tuple[str, int, float]]:
        p = shape.profile
        lim = make_limit(LimitSettings(), parallelism=p.parallelism, pp_size=p.pp_size)
        closed_loop_through_limit(
            shape.profile, clients, lim, duration_s=at + 12.0, input_len=shape.input_len,
            output_len=shape.output_len, seed=shape.seed, clients_at_s=at,
        )  # fmt: skip
        return [(d.code.value, d.after, d.at - at) for d in lim.history if d.at > 0]

    together, later = decisions(0.0), decisions(2.0)
    assert [c for c, _, _ in later] == [c for c, _, _ in together] and "full" in (
        c for c, _, _ in later
    )
    for (_, a_limit, a_at), (_, b_limit, b_at) in zip(together, later, strict=True):
        assert b_limit == a_limit and abs(b_at - a_at) <= 1.0
