"""The model's tokenizer: HF ``tokenizers`` over tokenizer.json, plus tokenizer_config.json's special
tokens and chat template (rendered with Jinja2 in a sandbox, as transformers does); or the same
rebuilt from a GGUF file's metadata (``kvwire.model.gguf_tokenizer``)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from kvwire import tool_calls
from kvwire.files import LoadError, read_json, resolve_inside
from kvwire.model import gguf
from kvwire.model.gguf_tokenizer import build_tokenizer
from kvwire.model.source import model_source, token_text


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    # an assistant turn's calls: OpenAI's {"id", "type": "function", "function": {"name", "arguments"}}
    tool_calls: tuple[dict, ...] = ()
    tool_call_id: str = ""  # a "tool" turn: the call it answers
    name: str = ""  # a "tool" turn: the function's name

    def as_dict(self) -> dict:
        """The message as transformers' apply_chat_template takes it (a call's arguments as a dict)."""
        out: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"])}}
                                 for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        return out


def _arguments(function: dict):
    args = function.get("arguments", {})
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args


# The generation_config.json fields vLLM's OpenAI server takes as defaults for omitted request fields.
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class ModelTokenizer:
    """``model_dir``: an HF directory (tokenizer.json + tokenizer_config.json), a GGUF file or a
    directory holding one (tokenizer rebuilt from its metadata), or a registered model name."""

    def __init__(self, model_dir: str | Path):
        src = model_source(model_dir)
        model_dir = src.dir
        cfg = read_json(model_dir, "tokenizer_config.json", required=False) or {}
        gen = read_json(model_dir, "generation_config.json", required=False) or {}
        eos_ids = set()
        if src.gguf is not None:
            reader = gguf.open_gguf(src.gguf)
            built = build_tokenizer(reader, str(src.gguf))
            self.tok = built.tokenizer
            self.bos_token, self.eos_token = built.bos_token, built.eos_token
            self.chat_template: str | None = built.chat_template
            eos_ids.update(gguf.eos_token_ids(reader))
        else:
            path = resolve_inside(model_dir, "tokenizer.json")
            if not path.is_file():
                raise LoadError(f"{model_dir}: missing tokenizer.json")
            try:
                self.tok = Tokenizer.from_file(str(path))
            except Exception as e:  # noqa: BLE001 - tokenizers raises untyped errors for bad files
                raise LoadError(f"{path}: not a readable tokenizer.json ({e})") from e
            self.bos_token = token_text(cfg.get("bos_token"))
            self.eos_token = token_text(cfg.get("eos_token"))
            self.chat_template = chat_template_of(model_dir, cfg)
        self.bos_id = self.tok.token_to_id(self.bos_token) if self.bos_token else None
        if self.eos_token and self.tok.token_to_id(self.eos_token) is not None:
            eos_ids.add(self.tok.token_to_id(self.eos_token))
        gen_eos = gen.get("eos_token_id")
        eos_ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else [])
        self.eos_ids: frozenset[int] = frozenset(eos_ids)
        # generation_config.json's sampling values, what an OpenAI request that omits them gets (as vLLM)
        self.sampling_defaults: dict[str, float] = {
            k: gen[k] for k in GENERATION_DEFAULT_FIELDS
            if isinstance(gen.get(k), (int, float)) and not isinstance(gen.get(k), bool)}
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self._env = template_environment()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """``tools``: OpenAI's tool list, given to the template as transformers gives it; a template
        that takes no tools (or no tool calls) gets them in the Hermes format instead (kvwire.tool_calls)."""
        if not self.chat_template:
            raise LoadError("this model has no chat template (tokenizer_config.json's chat_template or a "
                            "GGUF's tokenizer.chat_template)")
        template = self._env.from_string(self.chat_template)
        native_tools, native_calls = "tools" in self.chat_template, "tool_calls" in self.chat_template
        msgs = [m.as_dict() if native_calls else hermes_message(m) for m in messages]
        if tools and not native_tools:
            msgs = with_system(msgs, tool_calls.hermes_system(tools))
        extra = {"tools": tools} if tools and native_tools else {}
        return template.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)

    def encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        # The template already places bos/special tokens; don't add them twice.
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


def hermes_message(m: ChatMessage) -> dict:
    """A turn for a template without tool support: calls and results written into its text."""
    content = m.content
    if m.tool_calls:
        calls = "\n".join(tool_calls.render_call(c["function"]["name"], c["function"].get("arguments", {}))
                          for c in m.tool_calls)
        content = f"{content}\n{calls}" if content else calls
    if m.role == "tool":
        content = f"<tool_response>\n{content}\n</tool_response>"
    return {"role": m.role, "content": content}


def with_system(msgs: list[dict], text: str) -> list[dict]:
    """``text`` first in the system turn (a new one when the conversation has none)."""
    if msgs and msgs[0]["role"] == "system":
        return [{**msgs[0], "content": f"{text}\n\n{msgs[0]['content']}" if msgs[0]["content"] else text}, *msgs[1:]]
    return [{"role": "system", "content": text}, *msgs]


def chat_template_of(model_dir: Path, cfg: dict) -> str | None:
    """The chat template transformers would use: ``chat_template.jinja`` beside the tokenizer when
    present, else tokenizer_config.json's ``chat_template`` (a string, or a list of named templates
    whose "default" is taken)."""
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    t = cfg.get("chat_template")
    if isinstance(t, list):
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        return named.get("default")
    return t


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(x, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def template_environment() -> ImmutableSandboxedEnvironment:
    """A sandboxed Jinja environment set up as transformers' ``apply_chat_template`` sets up its own
    (trim_blocks, lstrip_blocks, loop controls, ``raise_exception``, ``strftime_now`` and a ``tojson``
    that neither escapes HTML nor forces ASCII), so a model's template renders the same text here."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
