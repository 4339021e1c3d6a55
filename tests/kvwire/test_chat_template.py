"""Chat templates render the text transformers' ``apply_chat_template`` renders for the same template:
its helpers (``raise_exception``, ``strftime_now``, loop controls, a ``tojson`` that keeps non-ASCII),
``chat_template.jinja`` files beside the tokenizer, and named template lists."""
from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path

import jinja2
import pytest
from transformers import PreTrainedTokenizerFast

from kvwire.tokenizer import ChatMessage, ModelTokenizer

TINY = Path(__file__).resolve().parents[2] / "models" / "kvwire-tiny"
TEMPLATE = """{%- if messages[0].role != 'system' and messages | length > 3 -%}
{{- raise_exception('a conversation of more than 3 messages needs a system message') -}}
{%- endif -%}
Today is {{ strftime_now('%Y-%m-%d') }}.
{% for m in messages %}
{%- if m.role == 'skip' %}{% continue %}{% endif -%}
<|{{ m.role }}|>{{ m.content | tojson }}
{% if loop.index >= 5 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""
MESSAGES = [{"role": "system", "content": "Be brief. Émoji: 🙂 <b>"}, {"role": "user", "content": "Hi"},
            {"role": "skip", "content": "not shown"}, {"role": "user", "content": "¿Qué?"}]


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "m"
    shutil.copytree(TINY, d)
    return d


def oracle(d: Path, messages: list[dict]) -> str:
    return PreTrainedTokenizerFast.from_pretrained(str(d)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def ours(d: Path, messages: list[dict]) -> str:
    return ModelTokenizer(d).apply_chat_template([ChatMessage(m["role"], m["content"]) for m in messages])


def test_a_chat_template_jinja_file_renders_as_transformers_does(model_dir):
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    text = ours(model_dir, MESSAGES)
    assert text == oracle(model_dir, MESSAGES)
    assert datetime.now().strftime("%Y-%m-%d") in text and '"Émoji: 🙂 <b>"'[1:] in text and "not shown" not in text


def test_raise_exception_is_a_template_error_with_the_templates_message(model_dir):
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    with pytest.raises(jinja2.TemplateError, match="needs a system message"):
        ours(model_dir, MESSAGES[1:] * 2)


def test_named_templates_take_the_default(model_dir):
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": TEMPLATE}]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert ours(model_dir, MESSAGES) == oracle(model_dir, MESSAGES)


# A Qwen2.5-style template that takes tools and tool calls itself (abridged from Qwen's).
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are helpful.' }}
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' and tools %}{% continue %}{% endif -%}
<|im_start|>{{ m.role }}
{%- if m.content %}
{{ m.content }}{% endif %}
{%- if m.tool_calls %}
{%- for c in m.tool_calls %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
TOOL_TURNS = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
              {"role": "tool", "content": '{"temp": -3}', "tool_call_id": "call_1"}]


def test_a_template_with_tool_support_gets_tools_and_calls_as_transformers_gives_them(model_dir):
    (model_dir / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    ours_text = ModelTokenizer(model_dir).apply_chat_template(
        [ChatMessage(m["role"], m["content"], tuple(m.get("tool_calls", ())), m.get("tool_call_id", ""))
         for m in TOOL_TURNS], tools=TOOLS)
    # transformers takes a call's arguments as a dict (OpenAI's JSON text is parsed first, as vLLM does)
    hf_turns = [{**m, "tool_calls": [{**CALL, "function": {**CALL["function"], "arguments": {"city": "Oslo"}}}]}
                if m.get("tool_calls") else m for m in TOOL_TURNS]
    hf = PreTrainedTokenizerFast.from_pretrained(str(model_dir)).apply_chat_template(
        hf_turns, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours_text == hf
    assert '"name": "get_weather"' in ours_text and '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in ours_text


def test_a_template_without_tool_support_gets_the_hermes_format(model_dir):
    ours_text = ModelTokenizer(model_dir).apply_chat_template(
        [ChatMessage(m["role"], m["content"], tuple(m.get("tool_calls", ())), m.get("tool_call_id", ""))
         for m in TOOL_TURNS], tools=TOOLS)
    assert "<tools>\n" + json.dumps(TOOLS[0]["function"]) + "\n</tools>" in ours_text  # in the system turn
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in ours_text
    assert '<tool_response>\n{"temp": -3}\n</tool_response>' in ours_text
