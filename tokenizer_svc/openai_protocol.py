"""OpenAI's chat/completions JSON <-> the front door's GenerateTextRequest (parsing, validation, responses).

Transport-free: ``openai_http`` does the HTTP. Requests are checked field by field so a bad value
is a 400 naming its ``param``; the sampling fields (read, refused, defaulted) are ``openai_sampling``'s.
"""
from __future__ import annotations

import dataclasses
import json
import re
import time
from dataclasses import dataclass
from typing import Any

from protos.kvwire.v1 import kvwire_pb2 as pb
from tokenizer_svc.openai_errors import invalid, model_not_found
from tokenizer_svc.openai_sampling import best_of, boolean, response_format, sampling
from tokenizer_svc.openai_tools import ToolRequest, message_calls, parse_tools
from tokenizer_svc.server import validate_stops


def parse_json(raw: bytes) -> dict[str, Any]:
    def no_constants(name: str):  # NaN / Infinity are not JSON; Python's json would accept them
        raise ValueError(f"{name} is not a JSON number")
    # surrogateescape: bytes that are not UTF-8 become lone surrogates inside their string, so the
    # field holding them can be named below instead of refusing the whole body without a clue.
    text = raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else raw
    try:
        body = json.loads(text, parse_constant=no_constants)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid(f"the request body is not valid JSON: {e}", None, "invalid_json") from e
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_json")
    bad = _not_unicode(body, "")
    if bad is not None:
        raise invalid(f"{bad or 'a field name'} is not valid UTF-8 text (undecodable bytes or a lone surrogate "
                      "escape)", bad or None)
    return body


def _not_unicode(v: Any, path: str) -> str | None:
    """The path of the first string (value or key) holding a lone surrogate, else None."""
    if isinstance(v, str):
        return path if _SURROGATE.search(v) else None
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, item in items:
        if isinstance(k, str) and _SURROGATE.search(k):
            return path  # the key itself: name its parent
        sub = f"{path}.{k}" if isinstance(k, str) and path else k if isinstance(k, str) else f"{path}[{k}]"
        found = _not_unicode(item, sub)
        if found is not None:
            return found
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")


def _stops(body: dict) -> list[str]:
    v = body.get("stop")
    stops = [] if v is None else [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop must be a string or a list of strings", "stop")
    try:
        return list(validate_stops(stops))
    except ValueError as e:
        raise invalid(str(e).replace("stops[", "stop["), "stop") from e


@dataclass(frozen=True)
class ParsedRequest:
    """One validated OpenAI request, ready for ``TokenizerServicer.generate_text``."""
    request: pb.GenerateTextRequest
    chat: bool
    stream: bool
    include_usage: bool
    echo: bool = False  # completions: the prompt comes back before the completion (and its logprobs if asked)
    logprobs: int | None = None  # top logprobs asked for (0: the tokens' own only); None: no logprobs
    n: int = 1  # choices returned (each streamed with its index)
    # completions' best_of > n: choices generated (request.sampling.n; logprobs asked for to rank
    # them), of which the n with the highest cumulative logprob are returned; None: all are returned
    best_of: int | None = None
    structured_param: str | None = None  # the param that constrained the output (response_format, guided_*)
    tools: ToolRequest | None = None  # chat with tools in play (tool_choice not "none")


def _content(v: Any, i: int) -> str:
    if v is None or isinstance(v, str):
        return v or ""
    if isinstance(v, list):  # content parts: text only
        texts = []
        for j, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                              f"messages[{i}].content[{j}]")
            texts.append(part["text"])
        return "\n".join(texts)
    raise invalid("content must be a string or a list of text parts", f"messages[{i}].content")


def _messages(body: dict, tools: ToolRequest | None) -> pb.ChatMessages:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list of {role, content}", "messages")
    out = pb.ChatMessages(tools_json=json.dumps(tools.tools, ensure_ascii=False) if tools else "")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid("each message must be an object with a string role", f"messages[{i}]")
        role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name for system
        calls = message_calls(m, i)
        for name in ("tool_call_id", "name"):
            if m.get(name) is not None and not isinstance(m[name], str):
                raise invalid(f"{name} must be a string", f"messages[{i}].{name}")
        out.messages.add(role=role, content=_content(m.get("content"), i),
                         tool_calls_json=json.dumps(calls, ensure_ascii=False) if calls else "",
                         tool_call_id=m.get("tool_call_id") or "", name=m.get("name") or "")
    return out


def _prompt(body: dict) -> str:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        raise invalid("send one prompt per request (a list of prompts is not supported)", "prompt")
    if not isinstance(p, str):
        raise invalid("prompt must be a string (token-id prompts are not supported)", "prompt")
    if not p:
        raise invalid("prompt is empty", "prompt")
    return p


def parse_request(body: dict, chat: bool, served_model: str, request_id: str,
                  defaults: dict[str, float] | None = None) -> ParsedRequest:
    """``defaults``: the model's generation_config.json sampling values (ModelTokenizer.sampling_defaults),
    taken by fields the request omits; temperature falls back to 1.0 (OpenAI's, vLLM's)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required (GET /v1/models lists the served model)", "model",
                      "missing_required_parameter")
    if model != served_model:
        raise model_not_found(model)
    stream = boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options must be an object", "stream_options")
    include_usage = boolean(options or {}, "include_usage")
    structured = response_format(body)
    tools = parse_tools(body) if chat else None
    if not chat and body.get("tools") not in (None, []):
        raise invalid("tools are for /v1/chat/completions", "tools", "unsupported_parameter")
    if tools is not None and (forced := tools.constraint()) is not None:
        if structured is not None:
            raise invalid(f"tool_choice {tools.choice!r} constrains the output already; leave {structured[0]} unset",
                          structured[0])
        structured = forced
    req = pb.GenerateTextRequest(request_id=request_id, sampling=sampling(body, chat, defaults or {}, structured),
                                 stops=_stops(body))
    if chat:
        req.chat.CopyFrom(_messages(body, tools))
    else:
        req.text = _prompt(body)
    if chat and body.get("echo") not in (None, False):  # vLLM's chat echo: not implemented
        raise invalid("echo is not supported by this server on chat; leave it unset", "echo", "unsupported_parameter")
    logprobs = req.sampling.logprobs if req.sampling.HasField("logprobs") else None
    n = req.sampling.n if req.sampling.HasField("n") else 1
    k = best_of(body, chat)
    if k is not None and k > n:  # generate k; their logprobs rank them (dropped unless asked for)
        req.sampling.n = k
        if logprobs is None:
            req.sampling.logprobs = 0
    return ParsedRequest(req, chat, stream, include_usage, not chat and boolean(body, "echo"), logprobs, n,
                         k if k is not None and k > n else None, structured[0] if structured else None, tools)


# -- responses ---------------------------------------------------------------------------------

FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True)
class Responder:
    """Builds the response objects of one request (ids and timestamps shared by every chunk)."""
    chat: bool
    model: str
    request_id: str
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    def _envelope(self, obj: str, choices: list, usage: dict | None, **extra) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices, **extra, "usage": usage}

    def full(self, choices: list[tuple], usage: pb.Usage) -> dict[str, Any]:
        """``choices``: (text, finish reason, logprobs already in their shape: tokenizer_svc.openai_logprobs
        [, chat's tool_calls]) by index, the reason a FinishReason value or its name; ``usage``: the
        prompt's tokens once, the choices' completion tokens summed."""
        out = []
        for i, (text, finish, logprobs, *calls) in enumerate(choices):
            reason = finish if isinstance(finish, str) else FINISH_REASONS.get(finish)
            if self.chat:
                message = {"role": "assistant", "content": text, "refusal": None}
                if calls and calls[0]:
                    message["tool_calls"] = calls[0]
                out.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
            else:
                out.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason})
        return self._envelope("chat.completion" if self.chat else "text_completion", out, usage_dict(usage))

    def chunk(self, text: str | None, finish: int | str = 0, first: bool = False, logprobs: dict | None = None,
              index: int = 0, tool_calls: list[dict] | None = None) -> dict[str, Any]:
        """A streamed piece of choice ``index``; ``first`` (chat only) carries the assistant role;
        ``logprobs``: its tokens'; ``tool_calls``: chat's tool-call deltas ({"index", ...})."""
        reason = finish if isinstance(finish, str) else FINISH_REASONS.get(finish)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            return self._envelope("chat.completion.chunk", [choice], None)
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        return self._envelope("text_completion", [choice], None)

    def usage_chunk(self, usage: pb.Usage) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage_dict(usage))


def total_usage(lasts: list[pb.GenerateTextResponse]) -> pb.Usage:
    """The request's usage from each choice's last message: prompt tokens once, completions summed."""
    return pb.Usage(prompt_tokens=lasts[0].usage.prompt_tokens if lasts else 0,
                    completion_tokens=sum(m.usage.completion_tokens for m in lasts))


def usage_dict(u: pb.Usage) -> dict[str, int]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def models_list(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model, created)]}


def model_card(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "kvwire"}
