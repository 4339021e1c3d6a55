"""Bearer tokens at the OpenAI HTTP door (in the tokenizer's event loop, real aiohttp listener)."""
from __future__ import annotations

import asyncio

import aiohttp

from kvwire.config import DEFAULT_MODEL_DIR
from kvwire_serving.security import TokenSet
from kvwire.tokenizer import ModelTokenizer
from tokenizer_svc.openai_http import OpenAIHttpServer
from tokenizer_svc.server import TokenizerServicer


def test_http_door_needs_a_bearer_token_except_for_health():
    async def main():
        servicer = TokenizerServicer(ModelTokenizer(DEFAULT_MODEL_DIR), None, "kvwire-tiny")
        http = OpenAIHttpServer(servicer, "kvwire-tiny", tokens=TokenSet(["tok-1"]))
        port = await http.start("127.0.0.1:0")
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as s:
                async def get(path, auth=None):
                    headers = {"Authorization": auth} if auth else {}
                    async with s.get(base + path, headers=headers) as r:
                        return r.status, await r.json()
                status, body = await get("/v1/models")
                assert status == 401 and body["error"]["type"] == "authentication_error"
                assert (await get("/v1/models", "Bearer nope"))[0] == 401
                assert (await get("/v1/models", "Basic tok-1"))[0] == 401
                assert (await get("/v1/models", "Bearer tok-1"))[0] == 200
                assert (await get("/health"))[0] == 200
                async with s.post(base + "/v1/completions", json={"model": "kvwire-tiny", "prompt": "x"}) as r:
                    assert r.status == 401  # refused before the pipeline (decode is not even there)
        finally:
            await http.stop()
            servicer.close()
    asyncio.run(main())
