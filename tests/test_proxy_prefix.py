"""Prefix routing on real sockets: three fake upstreams that report a prefix cache in SGLang's
usage shape (``prompt_tokens_details.cached_tokens``) behind a proxy. A group's requests, and
a conversation's turns, land where their prefix went; the hit rates as predicted and as
reported show in /metrics and /admin/prefix; with prefix_affinity off, prompts are not read."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from proxy_support import fakes, running_proxy

SYSTEMS = [f"You are assistant number {g}; answer briefly and precisely. " * 8 for g in range(6)]


async def ask(session, url: str, messages: list[dict], stream: bool) -> str:
    body = {
        "model": "m",
        "messages": messages,
        "max_tokens": 2,
        "stream": stream,
        "stream_options": {"include_usage": True},
    }
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        await r.read()
        return r.headers["X-Pipefill-Backend"]


def samples(text: str, name: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[s.labels.get("backend", "")] = s.value
    return out


async def test_groups_and_conversations_stay_where_their_prefix_is_cached():
    async with fakes(3) as ups:
        for u in ups:
            u.prefix_cache = []
        async with running_proxy([u.url for u in ups]) as server:
            url = server.url
            async with aiohttp.ClientSession() as s:
                homes: dict[int, set[str]] = {}
                for i in range(24):  # one at a time: load never breaks a claim
                    g = i % len(SYSTEMS)
                    msgs = [
                        {"role": "system", "content": SYSTEMS[g]},
                        {"role": "user", "content": f"question {i}: what is {i} squared?"},
                    ]
                    homes.setdefault(g, set()).add(await ask(s, url, msgs, stream=i % 2 == 0))
                assert all(len(h) == 1 for h in homes.values()), homes
                assert len(set().union(*homes.values())) >= 2  # groups spread (rendezvous)

                convo = [{"role": "system", "content": "A long-running chat. " * 4}]
                served = []
                for turn in range(5):
                    convo.append({"role": "user", "content": f"turn {turn}, tell me more " * 3})
                    served.append(await ask(s, url, convo, stream=True))
                    convo.append({"role": "assistant", "content": f"answer {turn} " * 6})
                assert len(set(served)) == 1

                async with s.get(url + "/metrics") as r:
                    text = await r.text()
                async with s.get(url + "/admin/prefix") as r:
                    admin = await r.json()
    predicted = samples(text, "pipefill_backend_prefix_hit_rate_predicted")
    reported = samples(text, "pipefill_backend_prefix_hit_rate_reported")
    assert predicted and reported and set(predicted) == set(reported)
    for name in predicted:
        assert predicted[name] > 0.5 and reported[name] > 0.5  # the groups' prefixes hit
    cached = samples(text, "pipefill_backend_cached_tokens_total")
    assert sum(cached.values()) > 0
    assert samples(text, "pipefill_prefix_index_entries")[""] > 0
    assert admin["enabled"] and admin["index"]["entries"] > 0
    for name, rep in admin["reported"].items():
        if rep["prompt_tokens"]:
            bp = admin["index"]["backends"][name]
            assert bp["reports"] > 0 and bp["trust"] > 0.8  # its reports matched the claims


async def test_with_prefix_affinity_off_prompts_are_not_read():
    async with fakes(2) as ups:
        for u in ups:
            u.prefix_cache = []
        async with running_proxy(
            [u.url for u in ups], routing={"prefix_affinity": False, "policy": "round_robin"}
        ) as server:
            async with aiohttp.ClientSession() as s:
                msgs = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": "q"}]
                served = [await ask(s, server.url, msgs, stream=True) for _ in range(4)]
                async with s.get(server.url + "/admin/prefix") as r:
                    admin = await r.json()
                async with s.get(server.url + "/metrics") as r:
                    text = await r.text()
    assert len(set(served)) == 2  # round robin, as before
    assert admin["enabled"] is False
    assert "pipefill_prefix_index_entries" not in text
    assert sum(samples(text, "pipefill_backend_reported_prompt_tokens_total").values()) > 0
