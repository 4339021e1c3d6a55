"""A Hugging Face ``tokenizers.Tokenizer`` rebuilt from a GGUF file's tokenizer metadata (torch-free).

Two vocabularies, as llama.cpp reads them: ``gpt2`` (byte-level BPE: GPT-2, Llama 3, Qwen2, SmolLM;
split by the regex its pre-tokenizer name stands for) and ``llama`` (SentencePiece BPE with byte
fallback: Llama 2, Mistral, TinyLlama; merges recovered from the scores when the file has none).
CONTROL tokens become special added tokens and USER_DEFINED plain added tokens, matched whole.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from kvwire.files import LoadError
from kvwire.model.gguf import field

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split regex of the original tokenizer.json (llama-vocab.cpp's table).
SPLIT_REGEX = {name: _LLAMA3 for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx")}
SPLIT_REGEX.update({name: _QWEN2 for name in ("qwen2", "deepseek-r1-qwen", "megrez")})


@dataclass(frozen=True)
class GGUFTokenizer:
    tokenizer: Tokenizer
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None


def _byte_alphabet() -> dict[int, str]:
    # GPT-2's printable stand-ins for the 256 bytes (what tokenizers' ByteLevel uses).
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def _byte_level(tokens: list[str], types: list[int], merges: list[str], pre: str | None) -> Tokenizer:
    spell = _byte_alphabet()
    alphabet = set(spell.values())
    vocab = {}
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        # Control/user-defined tokens are matched as written; a normal token outside the byte
        # alphabet (some converters store raw text) is spelled byte by byte.
        if kind in (NORMAL, BYTE) and not set(tok) <= alphabet:
            tok = "".join(spell[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    regex = SPLIT_REGEX.get(pre or "")
    tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=regex is _LLAMA3))
    if regex is not None:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre == "smollm":  # SmolLM's tokenizer.json: every digit alone, then GPT-2's split
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:  # "gpt2", "default" and names we do not know: GPT-2's own split
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    return tk


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a token into two tokens, best
    score first (what transformers' converters do for files that store no merges)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for tok, score in zip(tokens, scores):
        for k in range(1, len(tok)):
            left, right = tok[:k], tok[k:]
            if left in vocab and right in vocab:
                found.append((-score, vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _sentencepiece(tokens: list[str], types: list[int], scores: list[float] | None, merges: list[str] | None,
                   unk: str | None, add_space_prefix: bool) -> Tokenizer:
    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    elif scores is not None:
        pairs = _spm_merges(tokens, scores)
    else:
        raise LoadError("a SentencePiece GGUF vocabulary needs tokenizer.ggml.scores or tokenizer.ggml.merges")
    tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if add_space_prefix
                                                else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tk.decoder = decoders.Sequence(steps)
    return tk


def build_tokenizer(reader, source: str) -> GGUFTokenizer:
    kind = field(reader, "tokenizer.ggml.model")
    tokens = field(reader, "tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise LoadError(f"{source}: the GGUF file has no tokenizer (tokenizer.ggml.model / tokens)")
    types = field(reader, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    merges = field(reader, "tokenizer.ggml.merges")

    def token(key: str) -> str | None:
        i = field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    if kind == "gpt2":
        if not merges:
            raise LoadError(f"{source}: a byte-level BPE (gpt2) GGUF vocabulary needs tokenizer.ggml.merges")
        tk = _byte_level(tokens, types, merges, field(reader, "tokenizer.ggml.pre"))
        add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        tk = _sentencepiece(tokens, types, field(reader, "tokenizer.ggml.scores"), merges, token("unknown"),
                            bool(field(reader, "tokenizer.ggml.add_space_prefix", True)))
        add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", True))  # llama.cpp's default here
    else:
        raise LoadError(f"{source}: GGUF tokenizer {kind!r} is not supported (supported: gpt2, llama)")
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
               if k in (CONTROL, UNKNOWN)]
    plain = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    tk.add_special_tokens(special)
    tk.add_tokens(plain)
    bos, eos = token("bos"), token("eos")
    if kind == "gpt2":
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    if add_bos and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
    return GGUFTokenizer(tokenizer=tk, bos_token=bos, eos_token=eos,
                         chat_template=field(reader, "tokenizer.chat_template"))
