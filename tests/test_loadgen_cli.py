"""`loadtest run` end to end against the fake server: files written, errors as one line."""

from __future__ import annotations

import os
import sys

import orjson
import pytest

from loadtest.cli import main
from loadtest.results import RunResult

sys.path.insert(0, os.path.dirname(__file__))
from loadgen_fake import FakeState, ThreadedFake


@pytest.fixture
def fake(unused_port):
    with ThreadedFake(FakeState(), unused_port) as server:
        yield server


def test_sweep_writes_results_csv_and_payloads(fake, tmp_path, capsys):
    out, csv, payloads = tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "p.jsonl"
    rc = main(
        [
            "run",
            "--url",
            fake.url,
            "--concurrency",
            "1,3",
            "--requests",
            "6",
            "--input-len",
            "uniform:4-8",
            "--output-len",
            "5",
            "--seed",
            "7",
            "--out",
            str(out),
            "--save-records",
            "--csv",
            str(csv),
            "--save-payloads",
            str(payloads),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    result = RunResult.load(out)
    assert [lv.concurrency for lv in result.levels] == [1, 3]
    assert result.metadata["model"] == "fake-model"  # from /v1/models
    assert result.metadata["workload"]["input_len"] == "uniform:4-8"
    assert "t_wall_offset" in result.metadata
    assert result.records and all(r.ok and r.completion_tokens == 5 for r in result.records)
    for level in result.levels:
        assert level.output_tokens_per_request.max == 5
        assert level.selfcheck["requested_concurrency"] == level.concurrency
    assert csv.read_text().count("\n") == 3
    lines = [orjson.loads(line) for line in payloads.read_bytes().splitlines()]
    assert len(lines) == len(result.records)
    # reproducible: the same seed gives the same payloads
    rc = main(
        [
            "run",
            "--url",
            fake.url,
            "--concurrency",
            "1",
            "--requests",
            "2",
            "--input-len",
            "uniform:4-8",
            "--output-len",
            "5",
            "--seed",
            "7",
            "--save-payloads",
            str(tmp_path / "p2.jsonl"),
        ]
    )
    again = [orjson.loads(x) for x in (tmp_path / "p2.jsonl").read_bytes().splitlines()]
    assert again[0]["body"] == lines[0]["body"]


@pytest.mark.parametrize(
    ("args", "status", "needle"),
    [
        (["--concurrency", "0"], 2, "positive integers"),
        (["--output-len", "normal:5"], 2, "bad length"),
        (["--concurrency", "2", "--rate", "3"], 2, "not both"),
        (["--header", "nocolon"], 2, "NAME:VALUE"),
        (["--dataset", "/nonexistent.json"], 1, "cannot read dataset"),
        (["--api", "generate", "--model", "x", "--url", "http://127.0.0.1:9/"], 1, "cannot reach"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(fake, args, status, needle, capsys):
    assert _rc(["run", "--url", fake.url, "--requests", "1", *args]) == status
    err = capsys.readouterr().err
    assert needle in err
    assert "Traceback" not in err


def test_server_errors_fail_the_run_in_one_line(fake, capsys):
    rc = main(
        [
            "run",
            "--url",
            fake.url,
            "--concurrency",
            "1",
            "--requests",
            "2",
            "--dataset",
            _dataset_file(fake, "FAIL500 please"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1
    assert "boom" in err and "Traceback" not in err


def _dataset_file(fake, prompt: str) -> str:
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".jsonl")
    os.write(fd, orjson.dumps({"prompt": prompt}) + b"\n")
    os.close(fd)
    return path


def _rc(argv: list[str]) -> int:
    """The exit status, whether argparse exits or the command returns."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def test_processes_merge_into_one_level(fake, tmp_path, capsys):
    fake.state.delay = 0.01  # requests long enough for the processes' workers to overlap
    out, payloads = tmp_path / "r.json", tmp_path / "p.jsonl"
    rc = main([
        "run", "--url", fake.url, "--concurrency", "3", "--requests", "6", "--processes", "2",
        "--input-len", "4", "--output-len", "5", "--out", str(out), "--save-records",
        "--save-payloads", str(payloads),
    ])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    result = RunResult.load(out)
    assert result.records and all(r.ok for r in result.records)
    assert sorted({r.worker for r in result.records}) == [0, 1, 2]  # 2 + 1 workers
    assert fake.state.peak == 3
    level = result.levels[0]
    assert level.selfcheck["processes"] == 2
    assert level.concurrency_max == 3
    bodies = [orjson.loads(x)["index"] for x in payloads.read_bytes().splitlines()]
    assert len(bodies) == len(result.records) and len(set(bodies)) == len(bodies)


def test_ctrl_c_stops_cleanly_and_writes_what_was_measured(fake, tmp_path):
    import signal
    import subprocess
    import time

    fake.state.delay = 0.01
    out = tmp_path / "r.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadtest.cli", "run", "--url", fake.url, "-c", "2",
         "--warmup", "0.2", "--duration", "60", "--output-len", "50", "--input-len", "4",
         "--out", str(out), "--save-records"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while fake.state.requests < 6 and time.monotonic() < deadline:  # preflight + a few
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    result = RunResult.load(out)
    assert result.levels and result.levels[0].selfcheck["interrupted"]
    assert result.records


def test_quick_is_a_one_minute_sweep_and_explicit_flags_win(monkeypatch):
    from loadtest import run_cli
    from loadtest.cli import build_parser

    seen = {}
    monkeypatch.setattr(run_cli, "_validate", lambda args: None)

    class Stop(Exception):
        pass

    def fake_sweep(options, config):
        seen.update(warmup=options.warmup, duration=options.duration, drain=options.drain_timeout)
        raise Stop

    monkeypatch.setattr("loadtest.runner.Sweep", fake_sweep)
    parser = build_parser(only="run")
    for argv, want in [
        (["run", "--url", "http://x", "--quick"], (5.0, 10.0, 5.0)),
        (["run", "--url", "http://x", "--quick", "--duration", "20"], (5.0, 20.0, 5.0)),
        (["run", "--url", "http://x"], (15.0, 45.0, 60.0)),
    ]:
        with pytest.raises(Stop):
            run_cli.run(parser.parse_args(argv))
        assert (seen["warmup"], seen["duration"], seen["drain"]) == want
        levels = 3  # the default 1,4,32
        if "--quick" in argv and "--duration" not in argv:
            assert levels * sum(want) <= 60
