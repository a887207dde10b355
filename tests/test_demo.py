"""`loadtest demo`: end to end (--quick, a subprocess), Ctrl-C, and the interpretation line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest.demo import (
    PROFILES,
    SCALED_PROXY_SETTINGS,
    TargetRun,
    interpret,
    proxy_settings,
)
from loadtest.results import RunResult
from loadtest.stats import Distribution, LevelSummary

TARGETS = [f"{p} direct" for p in PROFILES] + ["proxy"]
LEVELS = ["1", "4", "32"]
# the installed console script, as a user runs it
DEMO = [str(Path(sys.executable).with_name("loadtest")), "demo", "--quick", "--quiet"]


def table_rows(text: str) -> set[tuple[str, str]]:
    """(target, C) of every row of the comparison table in the demo's output."""
    rows: set[tuple[str, str]] = set()
    current = None
    for line in text.splitlines():
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip("│").split("│")]
        if cells[0]:
            current = cells[0]
        if current and cells[1].isdigit():
            rows.add((current, cells[1]))
    return rows


def urls(text: str) -> list[str]:
    """The servers the demo said it started."""
    return [w for line in text.splitlines() for w in line.split() if w.startswith("http://")]


def refused(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port.rstrip("/")))) != 0


def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def run_demo(args: list[str], cwd: Path, **kw) -> subprocess.Popen:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.Popen(
        DEMO + args,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        **kw,
    )


def reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_quick_demo_end_to_end(tmp_path):
    proc = run_demo([], tmp_path)  # the default --out-dir, relative to the working directory
    try:
        out, err = proc.communicate(timeout=60)
        children = children_of(proc.pid)
    finally:
        reap(proc)
    assert proc.returncode == 0, err
    assert "TIME-SCALED" in out and "--time-scale 0.05" in out
    assert table_rows(out) == {(t, c) for t in TARGETS for c in LEVELS}
    assert "At C=32 the proxy delivered" in out and "the best single backend" in out
    assert "Traceback" not in out + err
    results = {p.stem: RunResult.load(p) for p in (tmp_path / "demo-results").glob("*.json")}
    assert set(results) == {"pp8-direct", "tp8-direct", "ep8-direct", "proxy"}
    for name, result in results.items():
        assert [lv.concurrency for lv in result.levels] == [1, 4, 32], name
        assert all(lv.completed > 0 for lv in result.levels), name
        assert result.metadata["time_scale"] == 0.05
        assert result.metadata["demo"]["target"] in TARGETS
    assert ("demo.png" in out) == (tmp_path / "demo-results" / "demo.png").exists()
    # everything it started is gone: no child process, nothing listening
    assert children == []
    started = urls(out)
    assert len(started) >= 4
    assert all(refused(u) for u in started)


def test_ctrl_c_reports_what_was_measured_and_cleans_up(tmp_path):
    proc = run_demo(["--out-dir", str(tmp_path / "out"), "--duration", "40"], tmp_path)
    try:
        # wait until the first sweep is running
        seen = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            seen.append(line)
            if line.startswith("pp8 direct:"):
                break
        time.sleep(1.5)
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        reap(proc)
    out = "".join(seen) + out
    assert proc.returncode == 130, err
    assert "Traceback" not in out + err
    assert "stopping" in err
    assert ("pp8 direct", "1") in table_rows(out)
    assert not any(t == "proxy" for t, _ in table_rows(out))
    assert RunResult.load(tmp_path / "out" / "pp8-direct.json").levels
    assert all(refused(u) for u in urls(out))


# ---- pieces ---------------------------------------------------------------------------------


def level(c: int, tok_s: float, decode: float, tpot: float = 0.04) -> LevelSummary:
    return LevelSummary(
        concurrency=c,
        window=(0.0, 10.0),
        output_tok_s=tok_s,
        decode_tok_s=Distribution(p50=decode),
        tpot=Distribution(p50=tpot),
        ttft=Distribution(p99=0.5),
    )


def target(name: str, *levels: LevelSummary) -> TargetRun:
    return TargetRun(name, name, "http://x", result=RunResult(levels=list(levels)))


def test_interpretation_is_computed_from_the_numbers():
    runs = [
        target("pp8 direct", level(1, 24, 24.7), level(32, 390, 13)),
        target("tp8 direct", level(1, 26, 26.7), level(32, 580, 19)),
        target("ep8 direct", level(1, 26, 26.3), level(32, 630, 21)),
        target("proxy", level(1, 26, 26.5), level(32, 756, 23)),
    ]
    lines = interpret(runs)
    assert "1.20x the best single backend (ep8 direct, 630 tok/s)" in lines[0]
    assert "more than" in lines[0]
    assert "fastest backend (tp8 direct) did 26.7, the slowest (pp8 direct) 24.7" in lines[1]
    runs[-1] = target("proxy", level(1, 26, 26.5), level(32, 500, 23))
    assert "less than" in interpret(runs)[0]
    assert interpret(runs[:3]) == ["no proxy results to compare"]


class _Sim:
    def __init__(self, name: str, port: int) -> None:
        from loadtest.sim.profiles import load_profile

        self.profile = load_profile(name)
        self.host, self.port = "127.0.0.1", port


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_proxy_settings_defaults_scaled_and_hints_from_profiles(scale):
    from proxy.settings import Settings

    s = proxy_settings([_Sim(n, 30000 + i) for i, n in enumerate(PROFILES)], scale)
    defaults = Settings()
    assert s.routing.policy == defaults.routing.policy
    assert s.limits.algorithm == defaults.limits.algorithm
    for section, key in SCALED_PROXY_SETTINGS:
        want = max(getattr(getattr(defaults, section), key) * scale, 0.05)
        assert getattr(getattr(s, section), key) == pytest.approx(want)
    assert s.timeouts == defaults.timeouts  # timeouts are never scaled
    pp8 = next(b for b in s.backends if b.name == "pp8")
    assert (pp8.parallelism, pp8.pp_size, pp8.url) == ("pp", 8, "http://127.0.0.1:30000")
    assert s.server.port == 0


def test_bad_out_dir_fails_at_once_in_one_line(tmp_path, capsys):
    from loadtest.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["demo", "--quick", "--out-dir", str(blocker / "sub")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("loadtest demo: error: cannot create --out-dir")
    assert "Traceback" not in err
