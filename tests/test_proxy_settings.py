"""Configuration: file < env < CLI, per-backend overrides, errors that name the field."""

from __future__ import annotations

import os
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


# ---- errors name their source: the variable, the flag or the file, and the exact key --------


@pytest.mark.parametrize(
    ("env", "needles"),
    [
        (
            {"PIPEFILL_SERVER__PORT": "abc"},
            ["environment variable PIPEFILL_SERVER__PORT", "server.port", "integer", "'abc'"],
        ),
        (
            {"PIPEFILL_SERVER__API_KEYS": "k1"},
            ["PIPEFILL_SERVER__API_KEYS", "server.api_keys", "JSON list", "'k1'"],
        ),
        (
            {"PIPEFILL_BACKENDS": '{"url": "http://a:1"}'},
            ["environment variable PIPEFILL_BACKENDS", "backends", "list"],
        ),
        (
            {"PIPEFILL_BACKENDS": "[{"},
            ["PIPEFILL_BACKENDS", "JSON list of tables"],
        ),
        (
            {"PIPEFILL_SERVR__PORT": "9001"},
            ["PIPEFILL_SERVR__PORT", "no such setting", "did you mean PIPEFILL_SERVER__PORT"],
        ),
        ({"PIPEFILL_HEALTH__NOPE": "1"}, ["PIPEFILL_HEALTH__NOPE", "no such setting"]),
    ],
)
def test_environment_errors_name_the_variable_and_what_was_expected(tmp_path, env, needles):
    cfg = tmp_path / "p.toml"
    cfg.write_text("[server]\nport = 1000\n")
    with pytest.raises(ConfigError) as info:
        load_settings(cfg, environ=env)
    message = str(info.value)
    assert all(n in message for n in needles), message
    assert str(cfg) not in message  # the file is not to blame
    assert "EnvSettingsSource" not in message and "\n" not in message


def test_environment_names_are_case_insensitive_and_other_variables_ignored():
    s = load_settings(None, environ={"pipefill_server__port": "7", "PATH": "/bin"})
    assert s.server.port == 7


def test_file_errors_name_the_file_and_flag_errors_the_flag(tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text("[server]\nport = 'x'\n")
    with pytest.raises(ConfigError) as info:
        load_settings(cfg, environ={})
    assert str(info.value).startswith(f"{cfg}: server.port:")
    # the environment's value wins over the file's, so a bad file value is not the error
    assert load_settings(cfg, environ={"PIPEFILL_SERVER__PORT": "5"}).server.port == 5
    args = build_parser().parse_args(["--backend", "localhost:3000"])
    with pytest.raises(ConfigError) as info:
        load_settings(None, environ={}, **overrides_from(args))
    message = str(info.value)
    assert message.startswith("flag --backend: backends.0.url:")
    assert message.count("localhost:3000") == 1  # the value once, not twice
    assert "http://" in message  # what was expected


@pytest.mark.parametrize("url", ["http://h:1/v1", "http://h:1/v1/", "http://h:1/sglang/v1"])
def test_a_backend_url_ending_in_v1_is_refused_with_the_fix(url):
    with pytest.raises(ConfigError, match="without /v1"):
        load_settings(None, environ={}, backends=[{"url": url}])


def test_a_url_with_a_path_prefix_is_still_allowed():
    s = load_settings(None, environ={}, backends=[{"url": "http://h:1/sglang/"}])
    assert s.backends[0].url == "http://h:1/sglang"


def test_check_config_validates_and_exits(tmp_path, capsys, monkeypatch):
    from proxy.cli import main

    for key in list(os.environ):
        if key.upper().startswith("PIPEFILL_"):
            monkeypatch.delenv(key)
    assert main(["--config", str(ROOT / "config/proxy.toml"), "--check-config"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("configuration OK")
    assert all(f"backend {n}" in out for n in ("pp8", "tp8", "ep8"))
    monkeypatch.setenv("PIPEFILL_SERVER__PORT", "abc")
    assert main(["--config", str(ROOT / "config/proxy.toml"), "--check-config"]) == 2
    err = capsys.readouterr().err
    assert "PIPEFILL_SERVER__PORT" in err and "Traceback" not in err
