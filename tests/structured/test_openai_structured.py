"""Structured output through the real HTTP door on SmolLM2-135M-Instruct (three real service
processes): the ``openai`` SDK's ``chat.completions.parse`` with a pydantic model and LangChain's
``with_structured_output`` get output that parses against the schema, every time; response_format
json_object gives a JSON object; a schema the engine cannot compile is a 400 naming the param."""
from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

import openai
import pytest
from pydantic import BaseModel, Field

from kvwire.model import registry
from tools.stack import Stack, free_port

REAL = "smollm2-135m-instruct"
MODEL = REAL  # tokenizer_svc's default model id: the model's name
pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(not registry.is_cached(REAL),
                                 reason=f"{REAL} is not fetched (python -m tools.fetch_model {REAL})")]

SUBJECTS = ["a cat", "a teacher", "a pilot", "a baker", "a doctor", "a child", "a farmer", "a painter", "a king",
            "a robot", "a dog", "a nurse", "a singer", "a chef", "a sailor", "a student", "a writer", "a judge",
            "a miner", "a dancer", "a poet", "a knight", "a clown", "a monk", "a spy"]
PROMPTS = [f"Describe {s} as a person record." for s in SUBJECTS] + \
          [f"Invent a character who is {s}. Answer in JSON." for s in SUBJECTS]


class Mood(str, Enum):
    happy = "happy"
    sad = "sad"
    calm = "calm"


class Person(BaseModel):
    """Bounded fields: the grammar caps every string and number, so each output ends within max_tokens."""
    name: str = Field(pattern=r"^[A-Za-z .'-]{1,24}$")  # one token per character at worst
    age: int = Field(ge=0, le=120)
    mood: Mood
    likes_tea: bool


# The longest Person the grammar admits, one token per character at worst (compact separators):
# {"name": "<24>", "age": 120, "mood": "happy", "likes_tea": false} is 86 characters, then EOS.
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    port = free_port()
    s = Stack(model_dir=Path(REAL), weights="gguf", prefill_replicas=0, decode_pages=512,
              log_dir=tmp_path_factory.mktemp("logs"),
              extra={"tokenizer_svc": ["--http-listen", f"127.0.0.1:{port}"]})
    with s:
        s.http_base = f"http://127.0.0.1:{port}/v1"
        yield s


@pytest.fixture
def client(stack):
    with openai.OpenAI(base_url=stack.http_base, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_parse_with_a_pydantic_model_always_parses(client):
    from concurrent.futures import ThreadPoolExecutor

    def one(prompt: str):
        return client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                             response_format=Person, max_tokens=MAX_TOKENS, temperature=0)
    with ThreadPoolExecutor(8) as pool:  # batched in decode, as a served load is
        replies = list(pool.map(one, PROMPTS))
    assert len(replies) >= 50
    for r in replies:
        [choice] = r.choices
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Person), choice.message.content
        Person.model_validate_json(choice.message.content)  # the text itself, not only the SDK's view


def test_langchain_with_structured_output(stack):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=stack.http_base, api_key="unused", temperature=0,
                                      max_tokens=MAX_TOKENS, max_retries=0)
    structured = llm.with_structured_output(Person, method="json_schema")
    for subject in SUBJECTS[:5]:
        out = structured.invoke(f"Describe {subject} as a person record.")
        assert isinstance(out, Person)


def test_json_object_gives_a_json_object(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Return a JSON object describing a car."}],
              response_format={"type": "json_object"}, max_tokens=120, temperature=0)
    r = client.chat.completions.create(**kw)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert r.choices[0].finish_reason == "stop"  # json_object bounds nothing: this prompt's object ends
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert streamed == r.choices[0].message.content


def test_choice_and_regex_on_the_vllm_fields(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                       max_tokens=10, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="My phone number is", max_tokens=20, temperature=0,
                                  extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert __import__("re").fullmatch(r"\d{3}-\d{4}", r.choices[0].text)


@pytest.mark.parametrize("response_format, param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}, "response_format"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "response_format.json_schema"),
    ({"type": "xml"}, "response_format"),
])
def test_bad_schemas_are_400s_naming_the_param(client, response_format, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       response_format=response_format)
    assert e.value.body["param"] == param and e.value.body["message"]


# -- tool calls --------------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The current time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"}},
                       "required": ["city"], "additionalProperties": False}}}]
QUESTIONS = ["What is the weather in Paris?", "Is it cold in Oslo now?", "How warm is Rome today?"]


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_tool_calling_flow(client, tool_choice):
    """call -> tool message -> answer, as the openai SDK's tool-calling examples run it."""
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=tool_choice,
                                           max_tokens=64, temperature=0)
        message = r.choices[0].message
        [call] = message.tool_calls  # constrained: always one call that parses
        assert call.function.name in ("get_weather", "get_time") and call.id
        args = json.loads(call.function.arguments)
        assert set(args) == set(TOOLS[0 if call.function.name == "get_weather" else 1]["function"]["parameters"]
                                ["required"])
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
        answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                                max_tokens=24, temperature=0)
        assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_tool_calls_stream_as_deltas(client, tool_choice):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}], tools=TOOLS, max_tokens=64,
              temperature=0, tool_choice=tool_choice)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    deltas = [d for c in client.chat.completions.create(stream=True, **kw) if c.choices
              for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == whole.function.name and len(deltas) > 2  # the arguments piece by piece
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
