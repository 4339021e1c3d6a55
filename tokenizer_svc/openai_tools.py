"""OpenAI's ``tools`` / ``tool_choice`` on the chat door: the request side (validated tools, rendered
by the chat template: ``kvwire.tokenizer``) and the reply side (the model's calls as ``tool_calls``,
whole or streamed as deltas).

    tool_choice "none"              tools not rendered, output is text
    tool_choice "auto" (default)    tools rendered; ``<tool_call>{...}</tool_call>`` blocks (Hermes,
                                    kvwire.tool_calls) become calls, the rest is content
    tool_choice "required"          output constrained to {"name": <a tool>, "arguments": <its schema>}
                                    (streamed: the name once written, then the arguments as they come)
    {"type": "function", ...}       output constrained to that function's parameters schema
Constrained calls always parse (structured output, kvwire.grammar); their finish reason is
"tool_calls" ("stop" for a named function, as OpenAI).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvwire import tool_calls
from kvwire.sampling_params import StructuredKind, StructuredOutput
from kvwire.tool_calls import ToolCall
from tokenizer_svc.openai_errors import invalid

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
# how a required call's constrained output starts (xgrammar's compact separators, the schema's order)
_REQUIRED_HEAD = re.compile(r'\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict[str, Any]]  # OpenAI's {"type": "function", "function": {...}}, validated
    choice: str  # "auto" | "required" | a function's name ("none" is no ToolRequest)
    named: bool = False

    def constraint(self) -> tuple[str, StructuredOutput] | None:
        """The structured output that makes a required / named call always parse."""
        if self.choice == "auto":
            return None
        params = {t["function"]["name"]: t["function"].get("parameters") or EMPTY_PARAMETERS for t in self.tools}
        if self.named:
            return "tool_choice", StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(params[self.choice]))
        schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "arguments": p},
                             "required": ["name", "arguments"], "additionalProperties": False}
                            for name, p in params.items()]}
        return "tool_choice", StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema))


def parse_tools(body: dict) -> ToolRequest | None:
    """``tools`` and ``tool_choice`` read and checked (a 400 names the field); None: no tools in play."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise invalid(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not _NAME.match(f["name"]):
            raise invalid("each tool must be {\"type\": \"function\", \"function\": {\"name\": [A-Za-z0-9_-]{1,64}, "
                          "\"description\"?, \"parameters\"?}}", f"tools[{i}]")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise invalid("parameters must be a JSON Schema object", f"tools[{i}].function.parameters")
        names.append(f["name"])
    if len(set(names)) != len(names):
        raise invalid("tools name a function twice", "tools")
    if choice is None or choice in ("auto", "required"):
        return ToolRequest(tools, choice or "auto")
    if choice == "none":
        return None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if name is None:
        raise invalid("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
                      "{\"name\": ...}}", "tool_choice")
    if name not in names:
        raise invalid(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return ToolRequest(tools, name, named=True)


def message_calls(m: dict, i: int) -> list[dict]:
    """An assistant message's ``tool_calls``, checked (they go back to the chat template)."""
    calls = m.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise invalid("tool_calls must be a list", f"messages[{i}].tool_calls")
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) \
                or not isinstance(f.get("arguments", "{}"), (str, dict)):
            raise invalid("each tool call must be {\"id\", \"type\": \"function\", \"function\": {\"name\", "
                          "\"arguments\"}}", f"messages[{i}].tool_calls[{j}]")
    return calls


def call_dict(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


@dataclass
class ToolReply:
    """One reply's calls, from its text (whole) or its pieces (streamed)."""
    req: ToolRequest
    splitter: tool_calls.StreamSplitter = field(default_factory=tool_calls.StreamSplitter)
    text: str = ""
    streamed_name: bool = False
    sent: int = 0  # required: the characters of ``text`` already sent as arguments (after the head)

    def final(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of the whole output ``text``."""
        if self.req.named:
            return None, [ToolCall(self.req.choice, text)] if text else []
        if self.req.choice == "required":
            try:
                call = tool_calls.call_of(json.loads(text))
            except ValueError:
                call = None  # cut short by max_tokens: left as text
            return (None, [call]) if call is not None else (text, [])
        content, calls = tool_calls.parse(text)
        return content or None, calls

    def finish_reason(self, calls: list[ToolCall], reason: str | None) -> str | None:
        if calls and reason == "stop" and not self.req.named:
            return "tool_calls"
        return reason

    def piece(self, text: str) -> tuple[str, list[dict]]:
        """A streamed piece -> (content to send now, tool_call deltas to send now)."""
        self.text += text
        if self.req.named:  # the name first, then the arguments as they come
            deltas = []
            if not self.streamed_name:
                self.streamed_name = True
                deltas.append({**call_dict(ToolCall(self.req.choice, "")), "index": 0})
            if text:
                deltas.append({"index": 0, "function": {"arguments": text}})
            return "", deltas
        if self.req.choice == "required":  # {"name": "<name>", "arguments": <arguments>}, compactly
            deltas = []
            if not self.streamed_name:
                head = _REQUIRED_HEAD.match(self.text)
                if head is None:
                    return "", []
                self.streamed_name, self.sent = True, head.end()
                deltas.append({**call_dict(ToolCall(head.group(1), "")), "index": 0})
            upto = len(self.text) - 1  # the last character may be the call's closing brace: held back
            if upto > self.sent:
                deltas.append({"index": 0, "function": {"arguments": self.text[self.sent:upto]}})
                self.sent = upto
            return "", deltas
        return self.splitter.feed(text), []

    def end(self) -> tuple[str, list[dict], list[ToolCall]]:
        """At the end of the stream: (content still to send, tool_call deltas, the calls)."""
        if self.req.named:
            return "", [], [ToolCall(self.req.choice, self.text)]
        if self.req.choice == "required":
            content, calls = self.final(self.text)
            if not self.streamed_name:
                return content or "", [call_dict(c, i) for i, c in enumerate(calls)], calls
            rest = self.text[self.sent:]
            rest = rest[:-1] if calls and rest.endswith("}") else rest  # the call's closing brace
            return "", [{"index": 0, "function": {"arguments": rest}}] if rest else [], calls
        held = self.splitter.held
        content, calls = tool_calls.parse(held) if held else ("", [])
        return content if calls else held, [call_dict(c, i) for i, c in enumerate(calls)], calls
