"""tools / tool_choice on the HTTP door, driven by the ``openai`` SDK against a scripted decode (the
reply is known, so the parsing is checked exactly): the tools reach the prompt through the chat
template (Hermes system prompt where the template takes none), ``<tool_call>`` blocks come back as
``tool_calls`` whole and as streamed deltas, required / named choices send decode a JSON Schema
constraint, and bad tools are 400s naming the field."""
import json

import openai
import pytest

from kvwire import tool_calls
from protos.kvwire.v1 import kvwire_pb2 as pb
from tests.tokenizer_svc.scripted_decode import ScriptedDecode
from tests.tokenizer_svc.test_openai_http import CHAT, MODEL, door, run

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "noop"}}]
REPLY = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def ask(tokenizer, reply: str, stream: bool, **kw):
    decode = ScriptedDecode(tokenizer.encode(reply, add_special_tokens=False), finish=pb.FINISH_REASON_STOP)

    async def main():
        async with door(tokenizer, decode) as (client, _):
            r = await client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, stream=stream, **kw)
            return [c async for c in r] if stream else r
    return run(main()), decode


def test_auto_renders_tools_and_parses_calls_whole(tokenizer):
    r, decode = ask(tokenizer, REPLY, False)
    [choice] = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    prompt = tokenizer.decode(list(decode.requests[0].prompt_token_ids), skip_special_tokens=False)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt  # the Hermes system prompt
    assert not decode.requests[0].sampling.HasField("structured")  # auto: not constrained


def test_auto_streams_content_then_call_deltas(tokenizer):
    chunks, _ = ask(tokenizer, REPLY, True)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert content == "Let me look.\n" and "<tool_call>" not in content
    assert [d.function.name for d in deltas] == ["get_weather"] and deltas[0].index == 0
    assert json.loads(deltas[0].function.arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_text_that_only_looks_like_a_call_stays_content(tokenizer):
    text = "Use <tool_ like this: <tool_call>not json</tool_call>"
    r, _ = ask(tokenizer, text, False)
    assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
    chunks, _ = ask(tokenizer, text, True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


@pytest.mark.parametrize("stream", [False, True])
def test_named_choice_is_constrained_and_streams_arguments(tokenizer, stream):
    out, decode = ask(tokenizer, '{"city": "Rome"}', stream,
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    s = decode.requests[0].sampling.structured
    assert json.loads(s.json_schema) == TOOLS[0]["function"]["parameters"]
    if stream:
        deltas = [d for c in out if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert deltas[0].function.name == "get_weather" and deltas[0].id
        assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Rome"}
        assert len(deltas) > 2  # the arguments came piece by piece
    else:
        [call] = out.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
        assert out.choices[0].message.content is None and out.choices[0].finish_reason == "stop"


def test_required_choice_is_constrained_to_one_of_the_tools(tokenizer):
    r, decode = ask(tokenizer, '{"name": "noop", "arguments": {}}', False, tool_choice="required")
    schema = json.loads(decode.requests[0].sampling.structured.json_schema)
    assert [a["properties"]["name"]["const"] for a in schema["anyOf"]] == ["get_weather", "noop"]
    [call] = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments, r.choices[0].finish_reason) == ("noop", "{}", "tool_calls")


def test_required_call_streams_its_name_then_its_arguments(tokenizer):
    chunks, _ = ask(tokenizer, '{"name": "get_weather", "arguments": {"city": "Lima"}}', True, tool_choice="required")
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id and len(deltas) > 2
    assert "".join(d.function.arguments or "" for d in deltas) == '{"city": "Lima"}'
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_past_calls_and_results_reach_the_template(tokenizer):
    messages = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": -3}'}]
    decode = ScriptedDecode(tokenizer.encode("Cold.", add_special_tokens=False), finish=pb.FINISH_REASON_STOP)

    async def main():
        async with door(tokenizer, decode) as (client, _):
            return await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    r = run(main())
    assert r.choices[0].message.content == "Cold." and r.choices[0].finish_reason == "stop"
    prompt = tokenizer.decode(list(decode.requests[0].prompt_token_ids), skip_special_tokens=False)
    assert tool_calls.render_call("get_weather", {"city": "Oslo"}) in prompt
    assert '<tool_response>\n{"temp": -3}\n</tool_response>' in prompt


@pytest.mark.parametrize("kwargs, param", [
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0]"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), "tools[0].function.parameters"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "other"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (dict(messages=[{"role": "assistant", "tool_calls": [{"function": {}}]}]), "messages[0].tool_calls[0]"),
])
def test_bad_tools_are_400s_naming_the_field(tokenizer, kwargs, param):
    decode = ScriptedDecode(tokenizer.encode("ok", add_special_tokens=False))

    async def main():
        async with door(tokenizer, decode) as (client, _):
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(**{"model": MODEL, "messages": CHAT, **kwargs})
            return e.value
    err = run(main())
    assert err.body["param"] == param
    assert not decode.requests


def test_stream_splitter_holds_back_only_a_possible_tag():
    s = tool_calls.StreamSplitter()
    assert [s.feed(p) for p in ["Hi <to", "ol", "_x> and <tool_c", "all>{}"]] == ["Hi ", "", "<tool_x> and ", ""]
    assert s.in_call and s.held == "<tool_call>{}"
