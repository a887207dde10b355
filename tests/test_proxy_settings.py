"""Configuration: file < env < CLI, per-backend overrides, errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.cli import build_parser, overrides_from
from proxy.settings import ConfigError, load_settings

ROOT = Path(__file__).resolve().parents[1]


def test_example_config_is_the_three_deployments():
    s = load_settings(ROOT / "config/proxy.toml")
    assert [(b.name, b.parallelism, b.pp_size) for b in s.backends] == [
        ("pp8", "pp", 8),
        ("tp8", "tp", None),
        ("ep8", "ep", None),
    ]
    assert s.upstream.keepalive_s < 5  # below SGLang's uvicorn keep-alive


def test_precedence_cli_over_env_over_file(tmp_path, monkeypatch):
    cfg = tmp_path / "p.toml"
    cfg.write_text(
        '[server]\nport = 1000\nhost = "10.0.0.1"\nshutdown_grace_s = 7\n'
        '[[backends]]\nurl = "http://a:1"\n'
    )
    s = load_settings(cfg)
    assert (s.server.port, s.server.host, s.server.shutdown_grace_s) == (1000, "10.0.0.1", 7)
    assert s.backends[0].name == "a:1"
    monkeypatch.setenv("PIPEFILL_SERVER__PORT", "2000")
    monkeypatch.setenv("PIPEFILL_HEALTH__INTERVAL_S", "0.5")
    s = load_settings(cfg)
    assert (s.server.port, s.server.host, s.health.interval_s) == (2000, "10.0.0.1", 0.5)
    args = build_parser().parse_args(
        ["--port", "3000", "--backend", "http://b:2", "--backend", "http://c:3/"]
    )
    s = load_settings(cfg, **overrides_from(args))
    assert s.server.port == 3000 and s.server.host == "10.0.0.1"  # nested keys merge
    assert [b.url for b in s.backends] == ["http://b:2", "http://c:3"]
    monkeypatch.setenv("PIPEFILL_BACKENDS", '[{"url": "http://env:9", "name": "e"}]')
    assert [b.name for b in load_settings(cfg).backends] == ["e"]


def test_per_backend_limit_overrides(tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text(
        '[limits]\nmax_limit = 64\n[[backends]]\nurl = "http://a:1"\n'
        'limits = { max_limit = 16 }\n[[backends]]\nurl = "http://b:1"\n'
    )
    s = load_settings(cfg)
    assert s.backend_limits(s.backends[0]).max_limit == 16
    assert s.backend_limits(s.backends[1]).max_limit == 64


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[server]\nport = 'x'\n", "server.port"),
        ("[server]\nprot = 1\n", "server.prot"),
        ("[health]\npath = 'health'\n", "health.path"),
        ("[[backends]]\nurl = 'ftp://x'\n", "backends.0.url"),
        ("[[backends]]\nurl = 'http://x:1'\nparallelism = 'dp'\n", "backends.0.parallelism"),
        ("[[backends]]\nurl = 'http://x:1'\n[[backends]]\nurl = 'http://x:1'\n", "duplicate"),
        ("[[backends]]\nurl = 'http://x:1'\nlimits = { max_limt = 3 }\n", "max_limt"),
        ("[routing]\npolicy = 'fastest'\n", "routing.policy"),
        ("[server\n", "invalid TOML"),
    ],
)
def test_invalid_values_name_the_field(tmp_path, text, needle):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(cfg)
    message = str(info.value)
    assert needle in message and "\n" not in message


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "nope.toml")
