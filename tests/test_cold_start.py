"""benchmarks/cold_start.py: what it reports of one start (virtual time, a fraction of a second)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import cold_start

from loadtest.sim.shapes import generate_shape


def test_decisions_are_timed_from_the_clients_arrival_and_the_servers_word_is_left_out():
    """The word comes at t = 0, before the clients; the decisions listed are the limit's answers
    to them, timed from their arrival, so starts with the clients at 1 s and at 3 s list the
    same ones (they see the same engine from the same state)."""
    shape = generate_shape(150)  # prefill-bound, tune split
    early, late = cold_start.run_shape(shape, 1.0), cold_start.run_shape(shape, 3.0)
    assert early["decisions"] and all(code != "server" for code, _, _ in early["decisions"])
    assert [(c, n) for c, n, _ in early["decisions"]] == [(c, n) for c, n, _ in late["decisions"]]
    for (_, _, t1), (_, _, t3) in zip(early["decisions"], late["decisions"], strict=True):
        assert abs(t1 - t3) <= 1.0 and t1 > 0
    assert early["clients"] == 2 * shape.est.capacity
    assert 0.9 < early["window_ratio"] <= 1.1
