"""Prompt sets for the speculative decoding benchmark, from real text on this machine.

Method and details: bench/README.md, section ``bench/prompts_spec.py``.
"""
from __future__ import annotations

import ast
import inspect
import itertools

from kvwire.tokenizer import ChatMessage

CODE_MODULES = ("textwrap", "shlex", "fnmatch", "glob", "posixpath", "string", "bisect", "heapq", "calendar")
DOC_TOPICS = ("assert", "break", "continue", "del", "global", "if", "pass", "raise", "return", "while",
              "with", "import", "try", "lambda", "for", "nonlocal")
CODE_TASKS = ("Add type hints to the signature of this function and give back the whole function, "
              "otherwise unchanged.",
              "Rename the local variables of this function to longer, descriptive names and give back "
              "the whole function.",
              "Add a docstring to this function (keep the existing code exactly) and give back the whole "
              "function.")
CHAT = ("Write a short poem about the sea at night.",
        "What are three tips for staying focused while studying?",
        "Explain in simple words why the sky is blue.",
        "Suggest a name for a small bakery and say why.",
        "What should I pack for a weekend hiking trip?",
        "Tell me a fun fact about octopuses.",
        "How do I make a good cup of tea?",
        "Describe your ideal weekend in a few sentences.",
        "Why do cats purr?",
        "Give me a simple recipe for pancakes.",
        "What is the difference between weather and climate?",
        "Write a friendly message inviting a neighbour to dinner.")


def _functions(max_lines: int, min_lines: int = 8):
    """Stdlib function sources of min..max lines, in a fixed order."""
    import importlib
    for name in CODE_MODULES:
        mod = importlib.import_module(name)
        src = inspect.getsource(mod)
        for node in ast.parse(src).body:
            if isinstance(node, ast.FunctionDef) and min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
                yield "\n".join(src.splitlines()[node.lineno - 1:node.end_lineno])


def _docs():
    """Statement pages first, then every other topic (sorted): as many as asked for."""
    from pydoc_data.topics import topics
    for name in [*DOC_TOPICS, *sorted(set(topics) - set(DOC_TOPICS))]:
        yield name, topics[name]


def _clip(tok, text: str, max_tokens: int) -> str:
    """Whole paragraphs (lines for code) while they fit in max_tokens tokens."""
    sep = "\n\n" if "\n\n" in text else "\n"
    out: list[str] = []
    for part in text.strip().split(sep):
        if len(tok.encode(sep.join(out + [part]), add_special_tokens=False)) > max_tokens:
            break
        out.append(part)
    return sep.join(out)


def grounded(tok, n: int, max_context: int = 400) -> list[str]:
    """n grounded task texts, the three kinds in turn."""
    funcs, docs = _functions(40), _docs()
    out = []
    for i in itertools.count():
        if len(out) == n:
            return out
        kind = i % 3
        if kind == 0:
            src = next(funcs)
            out.append(f"{CODE_TASKS[(i // 3) % len(CODE_TASKS)]}\n\n```python\n{src}\n```")
        else:
            name, doc = next(docs)
            doc = _clip(tok, doc, max_context)
            task = (f"Quote, word for word, the sentences of this page that explain what `{name}` is or does."
                    if kind == 1 else "Summarize this page in a few bullet points, quoting its key sentences verbatim.")
            out.append(f"Here is a page of the Python documentation:\n\n{doc}\n\n{task}")


def chat(n: int) -> list[str]:
    return [CHAT[i % len(CHAT)] for i in range(n)]


def encode(tok, text: str) -> list[int]:
    """Chat-formatted when the model has a template, else the plain text."""
    if tok.chat_template:
        return tok.encode_chat([ChatMessage(role="user", content=text)])
    return tok.encode(text)
