"""The model's tokenizer: HF ``tokenizers`` over tokenizer.json, plus tokenizer_config.json's special
tokens and chat template (rendered with Jinja2 in a sandbox, as transformers does); or the same
rebuilt from a GGUF file's metadata (``kvwire.model.gguf_tokenizer``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from kvwire.files import LoadError, read_json, resolve_inside
from kvwire.model import gguf
from kvwire.model.gguf_tokenizer import build_tokenizer
from kvwire.model.source import model_source, token_text


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


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
            self.chat_template = cfg.get("chat_template")
        self.bos_id = self.tok.token_to_id(self.bos_token) if self.bos_token else None
        if self.eos_token and self.tok.token_to_id(self.eos_token) is not None:
            eos_ids.add(self.tok.token_to_id(self.eos_token))
        gen_eos = gen.get("eos_token_id")
        eos_ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else [])
        self.eos_ids: frozenset[int] = frozenset(eos_ids)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise LoadError("this model has no chat template (tokenizer_config.json's chat_template or a "
                            "GGUF's tokenizer.chat_template)")
        template = self._env.from_string(self.chat_template)
        return template.render(messages=[{"role": m.role, "content": m.content} for m in messages],
                               add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        # The template already places bos/special tokens; don't add them twice.
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)
