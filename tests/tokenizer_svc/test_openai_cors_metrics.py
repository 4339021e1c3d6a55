"""The HTTP door's CORS (--cors-allowed-origins) and its request counter by route, method and status,
over real loopback HTTP (aiohttp as the browser; the counter read from prometheus_client's registry)."""
from __future__ import annotations

import aiohttp
import pytest
from prometheus_client import REGISTRY

from kvwire_serving.security import TokenSet
from tests.tokenizer_svc.scripted_decode import ScriptedDecode
from tests.tokenizer_svc.test_openai_http import CHAT, MODEL, door, run

ORIGIN = "https://app.example"


def _count(route: str, method: str, status: str) -> float:
    return REGISTRY.get_sample_value("kvwire:http_requests_total",
                                     {"route": route, "method": method, "status": status}) or 0.0


@pytest.mark.parametrize("stream", [False, True])
def test_allowed_origin_gets_cors_headers_and_a_preflight_before_auth(tokenizer, stream):
    decode = ScriptedDecode(tokenizer.encode("ok", add_special_tokens=False))

    async def main():
        async with door(tokenizer, decode, cors_origins=(ORIGIN,), tokens=TokenSet(["t"])) as (_, base), \
                aiohttp.ClientSession() as s:
            pre = await s.options(f"{base}/chat/completions", headers={
                "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type"})
            body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "stream": stream}
            ok = await s.post(f"{base}/chat/completions", json=body,
                              headers={"Origin": ORIGIN, "Authorization": "Bearer t"})
            await ok.read()
            other = await s.post(f"{base}/chat/completions", json=body,
                                 headers={"Origin": "https://evil.example", "Authorization": "Bearer t"})
            await other.read()
            other_pre = await s.options(f"{base}/chat/completions", headers={
                "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
            return pre, ok, other, other_pre
    pre, ok, other, other_pre = run(main())
    assert pre.status == 204 and pre.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in pre.headers["Access-Control-Allow-Methods"]
    assert pre.headers["Access-Control-Allow-Headers"] == "authorization,content-type"
    assert ok.status == 200 and ok.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert other.status == 200 and "Access-Control-Allow-Origin" not in other.headers
    assert other_pre.status in (401, 405) and "Access-Control-Allow-Origin" not in other_pre.headers


def test_no_cors_unless_configured(tokenizer):
    async def main():
        async with door(tokenizer, None) as (_, base), aiohttp.ClientSession() as s:
            r = await s.get(f"{base}/models", headers={"Origin": ORIGIN})
            return r.status, dict(r.headers)
    status, headers = run(main())
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


def test_requests_are_counted_by_route_method_and_status(tokenizer):
    decode = ScriptedDecode(tokenizer.encode("ok", add_special_tokens=False))
    route = "/v1/chat/completions"
    before = {s: _count(route, "POST", s) for s in ("200", "400", "404")}
    unmatched = _count("unmatched", "GET", "404")

    async def main():
        async with door(tokenizer, decode) as (_, base), aiohttp.ClientSession() as s:
            for body in ({"model": MODEL, "messages": CHAT, "max_tokens": 2},
                         {"model": MODEL, "messages": CHAT, "n": 17},
                         {"model": "gpt-4o", "messages": CHAT}):
                await (await s.post(f"{base}/chat/completions", json=body)).read()
            await (await s.get(f"{base}/no/such/path/123")).read()
    run(main())
    assert {s: _count(route, "POST", s) - before[s] for s in before} == {"200": 1, "400": 1, "404": 1}
    assert _count("unmatched", "GET", "404") - unmatched == 1


def test_the_flag_reaches_the_config():
    from kvwire.args import parse_args
    from tokenizer_svc.app import service_config

    args = parse_args("tokenizer_svc", ["--cors-allowed-origins", "https://a.example, https://b.example"])
    assert service_config(args).cors_allowed_origins == ("https://a.example", "https://b.example")
    assert service_config(parse_args("tokenizer_svc", [])).cors_allowed_origins == ()


@pytest.mark.parametrize("metrics", [False, True])
def test_metrics_on_the_http_port_only_when_asked_and_without_a_token(tokenizer, metrics):
    decode = ScriptedDecode(tokenizer.encode("ok", add_special_tokens=False))

    async def main():
        async with door(tokenizer, decode, tokens=TokenSet(["t"]), metrics=metrics) as (_, base), \
                aiohttp.ClientSession() as s:
            ok = await s.post(f"{base}/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2},
                              headers={"Authorization": "Bearer t"})
            await ok.read()
            r = await s.get(base.removesuffix("/v1") + "/metrics")
            return r.status, r.headers.get("Content-Type", ""), await r.text()

    status, ctype, text = run(main())
    if not metrics:
        assert status == 404
        return
    assert status == 200 and ctype.startswith("text/plain")
    # the request just served is in the scrape, as on the --metrics-port listener
    assert 'kvwire:http_requests_total{method="POST",route="/v1/chat/completions",status="200"}' in text
