"""The HTTP door's sampling controls, defaults and logprobs, through the official ``openai`` SDK.

Decode is scripted (tests/tokenizer_svc/scripted_decode.py): what the door sends it is recorded,
and its logprobs are known, so the response shapes are checked exactly. The values on the real
model are checked in test_openai_stack.py.
"""
from __future__ import annotations

import json
import shutil

import pytest

from kvwire.tokenizer import ModelTokenizer
from tests.tokenizer_svc.scripted_decode import ScriptedDecode
from tests.tokenizer_svc.test_openai_http import CHAT, MODEL, door, run


def test_controls_reach_decode(tokenizer):
    decode = ScriptedDecode(tokenizer.encode("ok", add_special_tokens=False))

    async def main():
        async with door(tokenizer, decode) as (client, _):
            await client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=8, presence_penalty=0.5, frequency_penalty=-0.25,
                logit_bias={"5": 3, "7": -250}, extra_body={"repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 2,
                                                             "stop_token_ids": [9, 11], "top_k": -1})
    run(main())
    s = decode.requests[0].sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p, s.min_tokens, s.top_k) == \
        (0.5, -0.25, pytest.approx(1.2), pytest.approx(0.1), 2, 0)
    assert dict(s.logit_bias) == {5: 3.0, 7: -250.0}  # clamped to [-100, 100] where applied (the engine)
    assert list(s.stop_token_ids) == [9, 11] and not s.HasField("logprobs")


def test_omitted_temperature_and_top_p_follow_generation_config(tokenizer, model_dir, tmp_path):
    shutil.copytree(model_dir, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9,
                                                                        "do_sample": True}))
    tok = ModelTokenizer(tmp_path / "m")
    decode = ScriptedDecode(tokenizer.encode("ok", add_special_tokens=False))

    async def main():
        async with door(tok, decode) as (client, _):
            await client.completions.create(model=MODEL, prompt="Hi")
            await client.completions.create(model=MODEL, prompt="Hi", temperature=0, top_p=1)
    run(main())
    first, second = (r.sampling for r in decode.requests)
    assert (first.temperature, first.top_p) == (pytest.approx(0.6), pytest.approx(0.9))
    assert (second.temperature, second.top_p) == (0.0, 1.0)  # asked for greedy: greedy


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_shape(tokenizer, stream):
    reply = tokenizer.encode("Hello world", add_special_tokens=False)
    decode = ScriptedDecode(reply)

    async def main():
        async with door(tokenizer, decode) as (client, _):
            r = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=len(reply),
                                                     logprobs=True, top_logprobs=2, stream=stream)
            if not stream:
                return r.choices[0].logprobs.content
            return [e for c in [c async for c in r] if c.choices and c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content]
    content = run(main())
    assert decode.requests[0].sampling.logprobs == 2
    assert [e.token for e in content] == [tokenizer.decode([t], skip_special_tokens=False) for t in reply]
    for e, t in zip(content, reply):
        assert e.logprob == pytest.approx(-t / 100) and e.bytes == list(e.token.encode())
        assert [x.logprob for x in e.top_logprobs] == pytest.approx([-t / 100, -(t + 1) / 100])
        assert e.top_logprobs[1].token == tokenizer.decode([t + 1], skip_special_tokens=False)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_logprobs_shape(tokenizer, stream):
    reply = tokenizer.encode("The quick fox", add_special_tokens=False)
    decode = ScriptedDecode(reply)

    async def main():
        async with door(tokenizer, decode) as (client, _):
            r = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=len(reply), logprobs=0,
                                                stream=stream)
            chunks = [r] if not stream else [c async for c in r]
            return [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    parts = run(main())
    tokens = [t for p in parts for t in p.tokens]
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in reply]
    assert tokens == texts
    assert [v for p in parts for v in p.token_logprobs] == pytest.approx([-t / 100 for t in reply])
    assert [o for p in parts for o in p.text_offset] == [sum(map(len, texts[:i])) for i in range(len(texts))]
    # logprobs=0: the sampled token's own entry only
    assert [list(d) for p in parts for d in p.top_logprobs] == [[t] for t in texts]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_echo_returns_the_prompt_and_its_logprobs(tokenizer, stream):
    reply = tokenizer.encode(" quick fox", add_special_tokens=False)
    decode = ScriptedDecode(reply)
    prompt = "The brown"

    async def main():
        async with door(tokenizer, decode) as (client, _):
            plain = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=len(reply), echo=True)
            r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=len(reply), echo=True,
                                                logprobs=1, stream=stream)
            chunks = [r] if not stream else [c async for c in r]
            return plain, chunks
    plain, chunks = run(main())
    assert plain.choices[0].text == prompt + tokenizer.decode(reply) and plain.choices[0].logprobs is None
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt + tokenizer.decode(reply)
    assert not decode.requests[0].sampling.HasField("prompt_logprobs")
    assert decode.requests[1].sampling.prompt_logprobs == 1
    ids = tokenizer.encode(prompt)
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    values = [v for p in parts for v in p.token_logprobs]
    assert values[0] is None
    assert values[1:] == pytest.approx([-t / 1000 for t in ids[1:]] + [-t / 100 for t in reply])
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in ids + reply]
    assert [t for p in parts for t in p.tokens] == texts
    assert [o for p in parts for o in p.text_offset] == [sum(map(len, texts[:i])) for i in range(len(texts))]
    assert [p for part in parts for p in part.top_logprobs][0] is None
