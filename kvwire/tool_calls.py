"""Tool calls in the Hermes format (vLLM's ``--tool-call-parser hermes``), for chat templates that
take no ``tools`` themselves (SmolLM2-Instruct's, for one): the tools go into a system prompt, past
calls and results into the turns' text, and the model's calls come back as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Torch-free; the chat template side is ``kvwire.tokenizer``, the OpenAI side ``tokenizer_svc.openai_tools``.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)

# NousResearch's Hermes 2 Pro function-calling system prompt (what Hermes-format models were trained on).
HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
    "what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-dict>}}\n</tool_call>")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text


def hermes_system(tools: Sequence[dict[str, Any]]) -> str:
    """The system prompt that lists ``tools`` (OpenAI's {"type": "function", "function": {...}})."""
    return HERMES_SYSTEM.format(tools="\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools))


def render_call(name: str, arguments: Any) -> str:
    """One past call as the model writes it (``arguments``: a dict or its JSON text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # kept as the text it was
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def call_of(obj: Any) -> ToolCall | None:
    """A {"name": str, "arguments": object} value as a call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """The model's output -> (the text outside complete calls, the calls). A block whose JSON is not
    a call stays in the text, as vLLM's hermes parser leaves it."""
    calls, kept, pos = [], [], 0
    for m in _BLOCK.finditer(text):
        try:
            call = call_of(json.loads(m.group(1)))
        except ValueError:
            call = None
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        calls.append(call)
        pos = m.end()
    kept.append(text[pos:])
    return "".join(kept).strip() if calls else text, calls


class StreamSplitter:
    """Streamed text -> the content that is surely not inside a call (sent as it comes); what
    follows an ``<tool_call>`` is held for ``parse`` at the end. A possible partial tag at the end
    of a piece is held back until the next piece decides it."""

    def __init__(self):
        self.held = ""  # text from the first "<tool_call>" (or a possible prefix of it) on
        self.in_call = False

    def feed(self, text: str) -> str:
        if self.in_call:
            self.held += text
            return ""
        text = self.held + text
        i = text.find(OPEN)
        if i >= 0:
            self.in_call, self.held = True, text[i:]
            return text[:i]
        keep = next((k for k in range(min(len(OPEN) - 1, len(text)), 0, -1) if OPEN.startswith(text[-k:])), 0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]
