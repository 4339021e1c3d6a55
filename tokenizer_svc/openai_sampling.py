"""The sampling half of an OpenAI request: which fields this server reads, refuses or accepts as
bookkeeping, and the SamplingParams message they make (``sampling``). Fields OpenAI (or vLLM)
defines that kvwire does not implement (``functions``, ``audio``, chat ``echo``, ...)
are refused rather than silently ignored; names that are neither OpenAI's nor vLLM's are ignored
and logged by the door, as vLLM does.

Each field is read alone first, so a bad value is a 400 naming its ``param``; the sampling rules
themselves are ``SamplingParams.validate()``'s, not repeated here. Omitted sampling fields take the
model's generation_config.json values, else OpenAI's (temperature 1.0), as vLLM does.
"""
from __future__ import annotations

import json
import math
from typing import Any

from kvwire.sampling_params import MAX_CHOICES, SamplingParams, StructuredKind, StructuredOutput
from protos import convert as conv
from protos.kvwire.v1 import kvwire_pb2 as pb
from tokenizer_svc.openai_errors import invalid

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat uses the service's
MAX_SEED = 2**64 - 1

# Fields of OpenAI's API (and vLLM's extensions) this server does not implement: refused with a 400
# naming the field unless they carry their no-op value, never silently ignored.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none", "auto"), "suffix": (None, ""), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,),
    "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,),
    # vLLM's extensions
    "prompt_logprobs": (None, 0), "allowed_token_ids": (None,), "bad_words": (None, []),
    "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0), "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,), "guided_decoding_backend": (None,), "structured_outputs": (None,),
    "logits_processors": (None,), "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "chat_template": (None,), "chat_template_kwargs": (None,), "documents": (None,),
    "return_tokens_as_token_ids": (None, False), "priority": (None, 0),
}
# Accepted with no effect on the output (bookkeeping OpenAI keeps; nothing here stores or bills):
# user, metadata, store, service_tier, parallel_tool_calls, prompt_cache_key, safety_identifier.
# Names in neither list nor read below are not OpenAI's: ignored (as vLLM does) and logged.
ACCEPTED_NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls",
                                "prompt_cache_key", "safety_identifier"})
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs; OpenAI's limit for chat's top_logprobs
# generation_config.json's sampling fields absent: what vLLM (and OpenAI) use for omitted fields
OPENAI_DEFAULTS: dict[str, float] = {"temperature": 1.0}


# -- field readers (each names its param on a bad value) ------------------------------------------

def number(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise invalid(f"{name} must be a finite number, got {json.dumps(v)}", name)
    return float(v)


def integer(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(f"{name} must be an integer, got {json.dumps(v)}", name)
    return v


def boolean(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"{name} must be true or false, got {json.dumps(v)}", name)
    return v


def _logit_bias(body: dict) -> dict[int, float] | None:
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid("logit_bias must be an object mapping token ids to biases", "logit_bias")
    out = {}
    for k, b in v.items():
        if not (isinstance(k, str) and k.isdigit()) or isinstance(b, bool) or not isinstance(b, (int, float)) \
                or not math.isfinite(b):
            raise invalid(f"logit_bias maps token ids (strings of digits) to finite numbers, got {json.dumps(k)}: "
                          f"{json.dumps(b)}", "logit_bias")
        out[int(k)] = float(b)
    return out


def _token_ids(body: dict, name: str) -> list[int] | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise invalid(f"{name} must be a list of token ids (non-negative integers)", name)
    return v


def _logprobs(body: dict, chat: bool) -> tuple[str, int] | None:
    """(the param that asked, how many top logprobs) or None: chat's logprobs (bool) + top_logprobs,
    completions' logprobs (int)."""
    if not chat:
        k = integer(body, "logprobs")
        if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
            raise invalid(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {k}", "logprobs")
        return None if k is None else ("logprobs", k)
    on, k = boolean(body, "logprobs"), integer(body, "top_logprobs")
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise invalid(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {k}", "top_logprobs")
    if k and not on:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    return ("top_logprobs" if k else "logprobs", k or 0) if on else None


def best_of(body: dict, chat: bool) -> int | None:
    """Completions' ``best_of`` (None: unset): candidates generated, the ``n`` most likely returned.
    Chat has none (OpenAI's chat API does not): there it may only repeat n."""
    n, k = integer(body, "n"), integer(body, "best_of")
    if k is None or k == (1 if n is None else n):
        return k
    if chat:
        raise invalid("best_of is not a chat completions parameter (use /v1/completions); leave it unset",
                      "best_of", "unsupported_parameter")
    if not (1 if n is None else n) <= k <= MAX_CHOICES:
        raise invalid(f"best_of must be in [n, {MAX_CHOICES}] (n={1 if n is None else n}), got {k}", "best_of")
    if boolean(body, "stream"):
        raise invalid("best_of > n cannot be streamed (as in OpenAI's API): set stream false or best_of = n",
                      "best_of")
    return k


def _schema_text(v: Any, param: str) -> str:
    if isinstance(v, str):  # vLLM's guided_json may be the schema's JSON text
        try:
            v = json.loads(v)
        except ValueError as e:
            raise invalid(f"{param} is not valid JSON: {e}", param) from e
    if not isinstance(v, (dict, bool)):
        raise invalid(f"{param} must be a JSON Schema object", param)
    return json.dumps(v, ensure_ascii=False)


def response_format(body: dict) -> tuple[str, StructuredOutput] | None:
    """(the param that asked, the constraint) from OpenAI's response_format or vLLM's guided_*
    fields (at most one of them), or None."""
    given = [name for name in ("response_format", *_GUIDED) if body.get(name) is not None]
    if len(given) > 1:
        raise invalid(f"set one of {', '.join(given)}, not several", given[1])
    if not given:
        return None
    name = given[0]
    v = body[name]
    if name == "guided_choice":
        if not isinstance(v, list) or not all(isinstance(c, str) for c in v):
            raise invalid("guided_choice must be a list of strings", name)
        return name, StructuredOutput(StructuredKind.CHOICE, choices=tuple(v))
    if name != "response_format":
        if name == "guided_json":
            return name, StructuredOutput(StructuredKind.JSON_SCHEMA, _schema_text(v, name))
        if not isinstance(v, str):
            raise invalid(f"{name} must be a string", name)
        return name, StructuredOutput(_GUIDED[name], v)
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                      "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}", name)
    if v["type"] == "text":
        return None
    if v["type"] == "json_object":
        return name, StructuredOutput(StructuredKind.JSON_OBJECT)
    spec = v.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise invalid("response_format.json_schema must be an object with a name and a schema",
                      "response_format.json_schema")
    if spec.get("schema") is None:  # OpenAI's schema is optional: then any JSON object
        return name, StructuredOutput(StructuredKind.JSON_OBJECT)
    return name, StructuredOutput(StructuredKind.JSON_SCHEMA,
                                  _schema_text(spec["schema"], "response_format.json_schema.schema"))


_GUIDED = {"guided_json": StructuredKind.JSON_SCHEMA, "guided_regex": StructuredKind.REGEX,
           "guided_choice": StructuredKind.CHOICE, "guided_grammar": StructuredKind.GRAMMAR}


def sampling(body: dict, chat: bool, defaults: dict[str, float],
             structured: tuple[str, StructuredOutput] | None = None) -> pb.SamplingParams:
    """``structured``: the constraint already read (``response_format``, or a tool choice's), with
    the param to name on a refusal."""
    best_of(body, chat)
    for name, allowed in _UNSUPPORTED.items():
        if body.get(name) not in allowed:
            raise invalid(f"{name} is not supported by this server; leave it unset", name, "unsupported_parameter")
    values: dict[str, tuple[str | None, Any]] = {}  # SamplingParams field -> (OpenAI param, value)
    for field, v in {**OPENAI_DEFAULTS, **defaults}.items():  # the model's generation_config, else OpenAI's
        values[field] = (None, v)
    for param in ("max_completion_tokens", "max_tokens"):  # the newer name wins when both are given
        if (v := integer(body, param)) is not None:
            values["max_tokens"] = (param, v)
            break
    else:
        if not chat:
            values["max_tokens"] = ("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    for param, read in (("temperature", number), ("top_p", number), ("top_k", integer), ("seed", integer),
                        ("presence_penalty", number), ("frequency_penalty", number),
                        ("repetition_penalty", number), ("min_p", number), ("min_tokens", integer),
                        ("logit_bias", lambda b, _: _logit_bias(b)), ("stop_token_ids", _token_ids),
                        ("n", integer)):
        if (v := read(body, param)) is not None:
            values[param] = (param, v)
    if values.get("top_k", (None, 0))[1] == -1:  # vLLM's spelling of "off"
        values["top_k"] = ("top_k", 0)
    if (lp := _logprobs(body, chat)) is not None:
        values["logprobs"] = lp
        if not chat and boolean(body, "echo"):  # echo with logprobs: the prompt's too
            values["prompt_logprobs"] = lp
    if body.get("ignore_eos") is not None:  # vLLM's extension: generate max_tokens whatever the model says
        if not isinstance(body["ignore_eos"], bool):
            raise invalid(f"ignore_eos must be a boolean, got {body['ignore_eos']!r}", "ignore_eos")
        values["ignore_eos"] = ("ignore_eos", body["ignore_eos"])
    if structured is not None:
        values["structured"] = structured
    if "seed" in values and not 0 <= values["seed"][1] <= MAX_SEED:
        raise invalid(f"seed must be in [0, 2^64), got {values['seed'][1]}", "seed")
    # Each field alone first, so a refusal names the param; then all together.
    for field, (param, v) in values.items():
        try:  # min_tokens alone: against any max_tokens (checked with the request's just below)
            SamplingParams(**{field: v, **({"max_tokens": v or 1} if field == "min_tokens" else {})}).validate()
        except ValueError as e:
            raise invalid(str(e) if param else f"the model's generation_config.json {field}: {e}", param) from e
    params = SamplingParams(**{"max_tokens": conv.DEFAULT_MAX_TOKENS, **{f: v for f, (_, v) in values.items()}})
    try:
        params.validate()
    except ValueError as e:
        raise invalid(str(e), None) from e
    m = conv.sampling_to_pb(params)
    if "max_tokens" not in values:
        m.ClearField("max_tokens")  # unset: the service's default
    return m


def unknown_fields(body: dict) -> list[str]:
    """Request fields this door neither reads, refuses nor accepts as bookkeeping (ignored, logged)."""
    return sorted(set(body) - _READ - set(_UNSUPPORTED) - ACCEPTED_NO_EFFECT)


_READ = frozenset({"model", "messages", "prompt", "stream", "stream_options", "n", "best_of", "stop", "max_tokens",
                   "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias",
                   "stop_token_ids", "logprobs", "top_logprobs", "ignore_eos", "echo", "response_format",
                   "tools", "tool_choice", *_GUIDED})
