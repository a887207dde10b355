"""benchmarks/fill_shapes.py: which generated shapes it runs, the workload and profile it gives
each simulator, and its verdict (no servers: the pure parts a bug would misreport through)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import fill_shapes
from harness import NGINX, nginx_argv, nginx_conf, toml_table

from loadtest.sim.profiles import Profile
from loadtest.sim.shapes import generate_shape
from loadtest.sim.tokens import CHAT_TOKENS_PER_MESSAGE, CHAT_TOKENS_PER_PROMPT
from loadtest.workload import LengthDist


def test_picks_only_affordable_shapes_of_the_kind_asked_in_seed_order():
    shapes, skipped = fill_shapes.pick_shapes(9000, 5, "pp")
    seeds = [s.seed for s in shapes]
    assert seeds == sorted(seeds) and seeds[0] >= 9000
    assert all(s.profile.parallelism == "pp" and fill_shapes.affordable(s) for s in shapes)
    # every seed in the range was either picked or counted as skipped
    assert len(shapes) + skipped == seeds[-1] - 9000 + 1
    skipped_seeds = set(range(9000, seeds[-1])) - set(seeds)
    for seed in skipped_seeds:
        s = generate_shape(seed)
        assert s.profile.parallelism != "pp" or not fill_shapes.affordable(s)


def test_affordable_bounds_request_time_rate_and_capacity():
    for seed in range(9000, 9040):
        s = generate_shape(seed)
        e = s.est
        expected = (
            e.request_s <= fill_shapes.MAX_REQUEST_S
            and e.tokens_per_s <= fill_shapes.MAX_TOKENS_PER_S
            and e.capacity <= fill_shapes.MAX_CAPACITY
        )
        assert fill_shapes.affordable(s) is expected


def test_lengths_are_the_shapes_workload_in_loadtests_forms():
    for seed in (9000, 9001, 9004):
        s = generate_shape(seed)
        inp, out = (LengthDist.parse(x) for x in fill_shapes.lengths(s))
        assert (inp.kind, inp.a) == ("fixed", s.input_len)
        lo, hi = s.output_len
        assert (out.kind, out.a, out.b) == ("uniform", lo, hi) if lo < hi else (out.a == lo)


def test_profile_written_as_toml_is_the_same_profile_and_fits_a_chat_prompt():
    s = generate_shape(9001)
    back = Profile.model_validate(tomllib.loads(toml_table(s.profile.model_dump())))
    assert back == s.profile
    chat = s.input_len + CHAT_TOKENS_PER_MESSAGE + CHAT_TOKENS_PER_PROMPT
    assert back.context_length >= chat + s.output_len[1]


def test_timing_stretches_to_the_shapes_request_time():
    args = argparse.Namespace(warmup=5.0, duration=25.0)
    quick, slow = generate_shape(9012), generate_shape(9000)  # ~0.9 s and ~7 s per request
    assert fill_shapes.timing(quick, args) == (5.0, 25.0)
    warmup, window = fill_shapes.timing(slow, args)
    assert warmup == pytest.approx(fill_shapes.WARMUP_REQUESTS * slow.est.request_s)
    assert window == max(25.0, fill_shapes.WINDOW_REQUESTS * slow.est.request_s)


def test_report_counts_a_shape_under_the_bar_or_unmeasured_as_not_met():
    def row(seed: int, direct: float | None, via: float | None) -> dict:
        tok = fill_shapes.ratio(via, direct)
        return {"shape": f"s{seed}", "binding": "cap", "capacity": 8, "clients": 16,
                "duration_s": 25.0, "direct": {"output_tok_s": direct},
                "proxy": {"output_tok_s": via, "limits": {"b": 9}}, "tok_ratio": tok,
                "met": fill_shapes.meets(tok)}  # fmt: skip

    rows = [row(1, 100.0, 96.0), row(2, 100.0, 94.0), row(3, 0.0, 50.0)]
    assert [r["met"] for r in rows] == [True, False, False]
    args = argparse.Namespace(
        command="x", parallelism=None, seed_base=9000, time_scale=1.0, nginx=False
    )
    md = fill_shapes.report(args, rows, skipped=2, wall=10.0)
    assert "VERDICT: 1/3 shapes" in md and "NOT met" in md


def test_report_with_the_nginx_reference_shows_its_ratio_and_keeps_the_verdict():
    row = {"shape": "s1", "binding": "kv", "capacity": 8, "clients": 16, "duration_s": 25.0,
           "direct": {"output_tok_s": 100.0}, "proxy": {"output_tok_s": 100.0},
           "nginx": {"output_tok_s": 108.0}, "nginx_ratio": 1.08, "tok_ratio": 1.0,
           "met": True}  # fmt: skip
    args = argparse.Namespace(
        command="x", parallelism=None, seed_base=9000, time_scale=1.0, nginx=True
    )
    md = fill_shapes.report(args, [row], skipped=0, wall=10.0)
    table = [line for line in md.splitlines() if line.startswith("|")]
    header, rule, cells = (line.strip("|").split("|") for line in table)
    assert len(header) == len(rule) == len(cells)
    assert cells[header.index(" nginx tok/s (/ direct) ")].strip() == "108 (1.080)"
    assert "VERDICT: 1/1 shapes" in md


def test_nginx_config_relays_to_the_backend_port(tmp_path):
    conf = nginx_conf(tmp_path / "ngx", 18001, 18002)
    text = conf.read_text()
    assert "listen 127.0.0.1:18001;" in text and "server 127.0.0.1:18002;" in text
    assert "{" + "port}" not in text and all((conf.parent / d).is_dir() for d in ("proxy",))
    if not Path(NGINX).exists():
        pytest.skip("nginx not installed")
    check = subprocess.run(
        [*nginx_argv(tmp_path / "ngx", 18001, 18002), "-t"], capture_output=True, timeout=10
    )
    assert check.returncode == 0, check.stderr


def test_tune_seeds_are_refused_before_anything_starts(monkeypatch):
    started = []
    monkeypatch.setattr(fill_shapes, "run_shape", lambda *a: started.append(a))
    with pytest.raises(SystemExit) as exc:
        fill_shapes.main(["--seed-base", "5"])
    assert exc.value.code == 2 and not started


@pytest.mark.parametrize("seeds", ["5", "9011,x", ""])
def test_seeds_outside_the_acceptance_split_or_not_numbers_are_refused(seeds, monkeypatch):
    started = []
    monkeypatch.setattr(fill_shapes, "run_shape", lambda *a: started.append(a))
    with pytest.raises(SystemExit) as exc:
        fill_shapes.main(["--seeds", seeds])
    assert exc.value.code == 2 and not started


def test_seeds_given_run_those_shapes_in_that_order(monkeypatch, tmp_path):
    ran = []

    def fake(args, shape, workdir):
        ran.append(shape.seed)
        return {"shape": shape.name, "binding": "cap", "capacity": 1, "clients": 2,
                "duration_s": 1.0, "direct": {}, "proxy": {}, "tok_ratio": 1.0,
                "met": True}  # fmt: skip

    monkeypatch.setattr(fill_shapes, "run_shape", fake)
    assert fill_shapes.main(["--seeds", "9018,9011", "--out", str(tmp_path / "r")]) == 0
    assert ran == [9018, 9011] and (tmp_path / "r.md").is_file()
