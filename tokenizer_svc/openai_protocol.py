"""OpenAI's chat/completions JSON <-> the front door's GenerateTextRequest (parsing, validation, responses).

Transport-free: ``openai_http`` does the HTTP. Requests are checked field by field so a bad value
is a 400 naming its ``param``; the sampling rules themselves are ``SamplingParams.validate()``'s,
not repeated here. Fields OpenAI defines that kvwire cannot honour (``n`` > 1, logprobs, tools,
penalties) are refused rather than silently ignored; unknown fields are ignored, as vLLM does.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any

from kvwire.sampling_params import SamplingParams
from protos import convert as conv
from protos.kvwire.v1 import kvwire_pb2 as pb
from tokenizer_svc.openai_errors import invalid, model_not_found
from tokenizer_svc.server import validate_stops

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat uses the service's
MAX_SEED = 2**64 - 1

# OpenAI fields kvwire refuses unless they carry their no-op value.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "tools": (None, []),
    "tool_choice": (None, "none", "auto"), "functions": (None, []), "function_call": (None, "none", "auto"),
    "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,), "response_format": (None, {"type": "text"}),
}


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


# -- field readers (each names its param on a bad value) ------------------------------------------

def _number(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise invalid(f"{name} must be a finite number, got {json.dumps(v)}", name)
    return float(v)


def _integer(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(f"{name} must be an integer, got {json.dumps(v)}", name)
    return v


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"{name} must be true or false, got {json.dumps(v)}", name)
    return v


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


def _sampling(body: dict, chat: bool) -> pb.SamplingParams:
    n = _integer(body, "n")
    if n is not None and n != 1:
        raise invalid(f"n must be 1 (kvwire returns one choice per request), got {n}", "n")
    for name, allowed in _UNSUPPORTED.items():
        if body.get(name) not in allowed:
            raise invalid(f"{name} is not supported by this server; leave it unset", name, "unsupported_parameter")
    values: dict[str, tuple[str, Any]] = {}  # SamplingParams field -> (OpenAI param, value)
    for param in ("max_completion_tokens", "max_tokens"):  # the newer name wins when both are given
        if (v := _integer(body, param)) is not None:
            values["max_tokens"] = (param, v)
            break
    else:
        if not chat:
            values["max_tokens"] = ("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    for param, read in (("temperature", _number), ("top_p", _number), ("top_k", _integer), ("seed", _integer)):
        if (v := read(body, param)) is not None:
            values[param] = (param, v)
    if body.get("ignore_eos") is not None:  # vLLM's extension: generate max_tokens whatever the model says
        if not isinstance(body["ignore_eos"], bool):
            raise invalid(f"ignore_eos must be a boolean, got {body['ignore_eos']!r}", "ignore_eos")
        values["ignore_eos"] = ("ignore_eos", body["ignore_eos"])
    if "seed" in values and not 0 <= values["seed"][1] <= MAX_SEED:
        raise invalid(f"seed must be in [0, 2^64), got {values['seed'][1]}", "seed")
    # Each field alone first, so a refusal names the param; then all together.
    for field, (param, v) in values.items():
        try:
            SamplingParams(**{field: v}).validate()
        except ValueError as e:
            raise invalid(str(e), param) from e
    params = SamplingParams(**{f: v for f, (_, v) in values.items()})
    try:
        params.validate()
    except ValueError as e:
        raise invalid(str(e), None) from e
    m = conv.sampling_to_pb(params)
    if "max_tokens" not in values:
        m.ClearField("max_tokens")  # unset: the service's default
    return m


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


def _messages(body: dict) -> pb.ChatMessages:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list of {role, content}", "messages")
    out = pb.ChatMessages()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid("each message must be an object with a string role", f"messages[{i}]")
        role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name for system
        out.messages.add(role=role, content=_content(m.get("content"), i))
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


def parse_request(body: dict, chat: bool, served_model: str, request_id: str) -> ParsedRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required (GET /v1/models lists the served model)", "model",
                      "missing_required_parameter")
    if model != served_model:
        raise model_not_found(model)
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options must be an object", "stream_options")
    include_usage = _boolean(options or {}, "include_usage")
    req = pb.GenerateTextRequest(request_id=request_id, sampling=_sampling(body, chat), stops=_stops(body))
    if chat:
        req.chat.CopyFrom(_messages(body))
    else:
        req.text = _prompt(body)
    return ParsedRequest(req, chat, stream, include_usage)


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

    def full(self, text: str, finish: int, usage: pb.Usage) -> dict[str, Any]:
        reason = FINISH_REASONS.get(finish)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                      "logprobs": None, "finish_reason": reason}
            return self._envelope("chat.completion", [choice], usage_dict(usage))
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return self._envelope("text_completion", [choice], usage_dict(usage))

    def chunk(self, text: str | None, finish: int = 0, first: bool = False) -> dict[str, Any]:
        """A streamed piece; ``first`` (chat only) carries the assistant role."""
        reason = FINISH_REASONS.get(finish)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            return self._envelope("chat.completion.chunk", [choice], None)
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return self._envelope("text_completion", [choice], None)

    def usage_chunk(self, usage: pb.Usage) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage_dict(usage))


def usage_dict(u: pb.Usage) -> dict[str, int]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def models_list(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model, created)]}


def model_card(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "kvwire"}
