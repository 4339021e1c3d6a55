"""Real text and chat prompts for distilling the SmolLM2 draft (tools/train_draft.py), built from
files every machine of this project has: Python's standard library sources, the package docs under
/usr/share/doc and this repository's docs. No downloads.

Every source file is assigned to train or held-out by a hash of its path (1 in 8 held out), so the
held-out prompts that measure acceptance (tools/eval_draft.py) quote text the draft never saw.
Deterministic: sorted file lists, a seeded RNG.
"""
from __future__ import annotations

import ast
import gzip
import hashlib
import random
import textwrap
import sysconfig
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
DOC_ROOT = Path("/usr/share/doc")
DOC_NAMES = ("README", "NEWS", "FAQ", "TODO", "HISTORY", "CHANGES")
MAX_DOC_BYTES = 200_000


def held_out(path: Path) -> bool:
    return hashlib.sha1(str(path).encode()).digest()[0] % 8 == 0


def _read(path: Path) -> str:
    try:
        raw = gzip.open(path).read(MAX_DOC_BYTES) if path.suffix == ".gz" else path.read_bytes()[:MAX_DOC_BYTES]
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return ""


def _doc_files() -> list[Path]:
    found = []
    if DOC_ROOT.is_dir():
        for p in sorted(DOC_ROOT.rglob("*")):
            stem = p.name.split(".")[0].upper()
            if p.is_file() and not p.is_symlink() and (stem in DOC_NAMES or p.suffix in (".md", ".rst", ".txt")):
                found.append(p)
    found += sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
    return found


@dataclass(frozen=True)
class Corpus:
    code: list[tuple[Path, str]]  # (path, source) of stdlib modules
    docs: list[tuple[Path, str]]  # (path, text) of prose documents


def load_corpus(split: str) -> Corpus:
    """split: 'train' or 'heldout'."""
    want = split == "heldout"
    code = [(p, _read(p)) for p in sorted(STDLIB.glob("*.py")) if held_out(p) == want]
    docs = [(p, _read(p)) for p in _doc_files() if held_out(p) == want]
    return Corpus([(p, t) for p, t in code if t.strip()], [(p, t) for p, t in docs if len(t.strip()) > 200])


def paragraphs(text: str, lo: int = 200, hi: int = 1200) -> list[str]:
    """Runs of blank-line separated paragraphs, joined up to ``hi`` characters, at least ``lo``."""
    out, cur = [], ""
    for para in (p.strip() for p in text.split("\n\n")):
        if not para:
            continue
        if cur and len(cur) + len(para) > hi:
            if len(cur) >= lo:
                out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para[:hi]
    if len(cur) >= lo:
        out.append(cur)
    return out


def functions(source: str, min_lines: int = 4, max_lines: int = 30) -> list[tuple[str, str, str]]:
    """(name, source, first docstring line) of top-level and method functions of a module."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out, lines = [], source.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
            seg = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
            if seg:
                doc = (ast.get_docstring(node) or "").strip().split("\n")[0]
                out.append((node.name, seg, doc))
    return out


FREE_TOPICS = [
    "how to stay focused while studying", "why the sky is blue", "the water cycle", "how a bicycle works",
    "healthy breakfast ideas", "what a black hole is", "how vaccines work", "the history of the printing press",
    "tips for writing a good email", "how to learn a new language", "what photosynthesis is",
    "the difference between weather and climate", "how to make a cup of tea", "why people dream",
    "how the internet works", "the benefits of regular exercise", "how a refrigerator keeps food cold",
    "what inflation is", "how to plan a small garden", "the rules of chess", "why leaves change color",
    "how airplanes fly", "what a computer virus is", "how to prepare for a job interview",
    "the solar system", "how to save money", "what recycling does", "how bees make honey",
    "the causes of earthquakes", "how to write a short story", "what machine learning is",
    "how the heart pumps blood", "what a database is", "how to cook rice", "why we have seasons",
]
TRAIN_TOPICS, HELDOUT_TOPICS = FREE_TOPICS[:28], FREE_TOPICS[28:]
FREE_FORMS = ["Explain {t} in simple terms.", "Can you tell me about {t}?", "Give me three short tips about {t}.",
              "Write a short paragraph about {t}.", "What should a beginner know about {t}?"]


# Everyday requests (poems, tips, notes, stories) on subjects none of bench/prompts_spec.py's chat
# prompts is about, so the benchmark's chat set stays unseen.
EVERYDAY_SUBJECTS = [
    "a houseplant", "learning to cook", "a long train journey", "saving money", "a birthday party",
    "morning routines", "running a first 5k", "keeping a journal", "dogs", "autumn", "a city park",
    "moving to a new town", "board games", "gardening", "a snowy day", "public libraries",
    "learning a new language", "camping", "a lighthouse", "coffee", "bicycles", "recycling",
    "a thunderstorm", "baking bread", "owls", "volunteering", "a museum visit", "packing for a move",
    "making friends", "the moon", "rivers", "a farmers market", "painting", "sleep", "a picnic",
    "time management", "a small balcony garden", "music practice", "a rainy afternoon", "elephants",
    "honey bees", "the desert", "a job interview", "cooking rice", "mountains", "writing letters",
    "a road trip", "kites", "old trees", "a lost umbrella"]
EVERYDAY_FORMS = [
    "Write a short poem about {t}.", "Give me three tips about {t}.", "Tell me a fun fact about {t}.",
    "Describe {t} in a few sentences.", "Write a friendly note to a friend about {t}.",
    "Why do people enjoy {t}?", "Suggest a name for a blog about {t} and say why.",
    "What should I know before trying {t}?", "Explain {t} to a child.",
    "Write the opening of a short story about {t}."]


def chat_prompts(corpus: Corpus, n: int, seed: int, free_topics: list[str] = TRAIN_TOPICS,
                 everyday_share: float = 0.0) -> list[str]:
    """``n`` user messages: grounded tasks over the corpus (summarize, quote, extract, explain or edit
    code, write a function from a docstring) and free questions, mixed; ``everyday_share`` of them
    replaced by everyday requests (EVERYDAY_FORMS x EVERYDAY_SUBJECTS)."""
    rng, pick = random.Random(seed), random.Random(seed + 1)
    everyday = [f.format(t=s) for f in EVERYDAY_FORMS for s in EVERYDAY_SUBJECTS]
    pick.shuffle(everyday)  # drawn in this order: no repeats before all 500 are used
    used = 0
    paras = [p for _, t in corpus.docs for p in paragraphs(t)]
    paras += [p for _, t in corpus.code for p in paragraphs(ast.get_docstring(_safe_parse(t)) or "")]
    funcs = [f for _, t in corpus.code for f in functions(t)]
    rng.shuffle(paras)
    rng.shuffle(funcs)
    out = []
    for i in range(n):
        if everyday_share and pick.random() < everyday_share:
            out.append(everyday[used % len(everyday)])
            used += 1
            continue
        kind = i % 8
        if kind in (0, 1) and paras:
            p = paras[i % len(paras)]
            out.append(rng.choice(["Summarize the following text in a few sentences:\n\n{p}",
                                   "Here is a document:\n\n{p}\n\nWhat are its main points?",
                                   "{p}\n\nSummarize this, quoting the most important sentence."]).format(p=p))
        elif kind == 2 and paras:
            p = paras[(i * 7) % len(paras)]
            words = [w.strip(".,:;()\"'`") for w in p.split() if len(w) > 6 and w.isalpha()]
            w = rng.choice(words) if words else p.split()[0]
            out.append(f"Here is a document:\n\n{p}\n\nQuote the sentence that mentions \"{w}\", word for word.")
        elif kind in (3, 4) and funcs:
            name, src, _ = funcs[i % len(funcs)]
            out.append(rng.choice(["Explain what this Python code does:\n\n```python\n{s}\n```",
                                   "Add type hints and a docstring to this function:\n\n```python\n{s}\n```",
                                   "Rewrite this function with clearer variable names:\n\n```python\n{s}\n```",
                                   "List the variables used in this function:\n\n```python\n{s}\n```"]).format(s=src))
        elif kind == 5 and funcs:
            with_doc = [f for f in funcs if len(f[2]) > 15]
            name, _, doc = with_doc[i % len(with_doc)] if with_doc else funcs[i % len(funcs)]
            out.append(f"Write a Python function `{name}` that does the following: {doc or name}")
        elif kind == 6 and paras:
            p = paras[(i * 3) % len(paras)]
            out.append(f"{p}\n\nExtract the names, commands or file names mentioned in this text as a list.")
        else:
            out.append(rng.choice(FREE_FORMS).format(t=rng.choice(free_topics)))
    return out


def _safe_parse(source: str):
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError):
        return ast.parse("")


def text_chunks(corpus: Corpus) -> list[str]:
    """Plain-text passages for teacher-forced distillation: code and prose, in order."""
    out = []
    for _, t in corpus.code:
        out += [t[i:i + 2000] for i in range(0, min(len(t), 40_000), 2000)]
    for _, t in corpus.docs:
        out += paragraphs(t, lo=300, hi=2000)
    return out
