"""``python -m tools.code_stats [PATH ...]``: size and hygiene figures of the tracked source tree.

Prints the largest files and functions, the comment+docstring share of lines, docstrings of 10+
lines, comment/docstring lines quoting machines or timings, distinct KVWIRE_* variables, function-level
imports between the project's modules and import cycles among them. PATHs (files or folders) restrict
the per-line figures to those files; the import figures always cover the whole tree.
"""
from __future__ import annotations

import argparse
import ast
import io
import re
import subprocess
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # --root replaces it (e.g. an exported older tree)
PACKAGES = ("kvwire", "kvwire_kernels", "protos", "tokenizer_svc", "prefill_svc", "decode_svc", "bench",
            "tools", "tests")
SOURCE_SUFFIXES = (".py", ".c", ".h", ".sh")
# A machine a figure came from, a rate, a duration, a speed ratio or "measured ... <number>": what
# goes stale in a comment when the next run differs.
MEASUREMENT = re.compile(
    r"\b(EPYC|Xeon|Ryzen|Graviton|H100|H200|A100|L40S?)\b|\d\s?(tok/s|GB/s|MB/s|GiB/s)|"
    r"\b\d[\d.,]*\s?(ms|µs|us|ns)\b|\bmeasured\b[^.;]*\d|\b\d[\d.]*x (faster|slower)\b", re.IGNORECASE)
ENV_VAR = re.compile(r"\bKVWIRE_[A-Z0-9_]+\b")


@dataclass
class FileStats:
    path: str
    lines: int = 0
    comment_lines: set[int] = field(default_factory=set)   # comment or docstring lines (1-based)
    long_docstrings: list[tuple[int, int]] = field(default_factory=list)   # (line, length)
    measurement_lines: list[int] = field(default_factory=list)
    functions: list[tuple[str, int]] = field(default_factory=list)   # (qualified name, lines)


def tracked_files() -> list[Path]:
    """git's tracked source files, or every source file under ROOT outside a git checkout."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        paths = out.splitlines()
    except (OSError, subprocess.CalledProcessError):
        paths = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if ".venv" not in p.parts]
    return [ROOT / p for p in paths
            if p.endswith(SOURCE_SUFFIXES) and "_pb2" not in p and (ROOT / p).is_file()]


def _python_stats(st: FileStats, text: str) -> None:
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                st.comment_lines.add(tok.start[0])
    except (tokenize.TokenError, SyntaxError):
        pass
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                doc = body[0]
                st.comment_lines.update(range(doc.lineno, doc.end_lineno + 1))
                n = doc.end_lineno - doc.lineno + 1
                if n >= 10:
                    st.long_docstrings.append((doc.lineno, n))

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    st.functions.append((name, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
    visit(tree, "")


def _c_stats(st: FileStats, text: str) -> None:
    in_block = False
    for i, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if in_block:
            st.comment_lines.add(i)
            in_block = "*/" not in s
        elif s.startswith("/*"):
            st.comment_lines.add(i)
            in_block = "*/" not in s[2:]
        elif "//" in s or "/*" in s:
            st.comment_lines.add(i)
            in_block = "/*" in s and "*/" not in s.split("/*", 1)[1]


def _shell_stats(st: FileStats, text: str) -> None:
    for i, line in enumerate(text.splitlines(), 1):
        if "#" in line and not line.startswith("#!"):
            st.comment_lines.add(i)


def file_stats(path: Path) -> FileStats:
    text = path.read_text(errors="replace")
    st = FileStats(str(path.relative_to(ROOT)), lines=len(text.splitlines()))
    {".py": _python_stats, ".sh": _shell_stats}.get(path.suffix, _c_stats)(st, text)
    lines = text.splitlines()
    st.measurement_lines = [i for i in sorted(st.comment_lines) if MEASUREMENT.search(lines[i - 1])]
    return st


# ---- imports ----------------------------------------------------------------------------------------
def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imported(node: ast.AST, module: str, is_pkg: bool, known: set[str]) -> list[str]:
    """The project modules an Import/ImportFrom node names (a package's submodules resolved)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = module.split(".") if is_pkg else module.split(".")[:-1]
            pkg = pkg[:len(pkg) - node.level + 1]
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = []
    for n in names:
        while n and n not in known:
            n = n.rpartition(".")[0]
        if n and n.split(".")[0] in PACKAGES:
            out.append(n)
    return out


def import_graph(files: list[Path]) -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """Module-level import edges, and function-level imports of project modules (module, line, target)."""
    py = [f for f in files if f.suffix == ".py" and f.relative_to(ROOT).parts[0] in PACKAGES]
    known = {module_name(f) for f in py}
    edges: dict[str, set[str]] = {m: set() for m in known}
    local: list[tuple[str, int, str]] = []
    for f in py:
        mod, is_pkg = module_name(f), f.name == "__init__.py"
        tree = ast.parse(f.read_text(errors="replace"))

        def walk(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if _type_checking_block(child):
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in sorted(set(_imported(child, mod, is_pkg, known))):
                        if target == mod:
                            continue
                        if in_function:
                            local.append((mod, child.lineno, target))
                        else:
                            edges[mod].add(target)
                walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))
        walk(tree, False)
    # importing a.b.c also runs a and a.b: a package's __init__ is part of the edge set implicitly.
    return edges, local


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", help="restrict the per-line figures to these files/folders")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--root", type=Path, help="the tree to measure (default: this checkout)")
    ap.add_argument("-v", "--verbose", action="store_true", help="list every long docstring and measurement line")
    args = ap.parse_args(argv)
    if args.root is not None:
        global ROOT
        ROOT = args.root.resolve()
    files = tracked_files()
    selected = files
    if args.paths:
        roots = [(ROOT / p).resolve() for p in args.paths]
        selected = [f for f in files if any(f == r or r in f.parents for r in roots)]
    stats = [file_stats(f) for f in selected]
    total = sum(s.lines for s in stats)
    comments = sum(len(s.comment_lines) for s in stats)
    long_docs = [(s.path, ln, n) for s in stats for ln, n in s.long_docstrings]
    measures = [(s.path, ln) for s in stats for ln in s.measurement_lines]
    env_vars: set[str] = set()
    for f in selected:
        env_vars.update(ENV_VAR.findall(f.read_text(errors="replace")))
    edges, local = import_graph(files)
    cyc = cycles(edges)
    deferred = {m: set(t) for m, t in edges.items()}
    for mod, _, target in local:
        deferred[mod].add(target)
    cyc_deferred = [c for c in cycles(deferred) if c not in cyc]
    statements = {(mod, ln) for mod, ln, _ in local}

    print(f"files: {len(stats)}  lines: {total}")
    print(f"comment+docstring lines: {comments} ({100 * comments / max(total, 1):.1f}%)")
    print(f"docstrings of 10+ lines: {len(long_docs)}")
    print(f"comment/docstring lines quoting machines or timings: {len(measures)}")
    print(f"distinct KVWIRE_* variables: {len(env_vars)}")
    print(f"function-level imports between project modules (whole tree): {len(statements)} statements, "
          f"{sum(1 for m, _ in statements if not m.startswith('tests.'))} outside tests")
    print(f"import cycles among project modules (whole tree): {len(cyc)} at module level, "
          f"{len(cyc_deferred)} more through function-level imports")
    for c in cyc + cyc_deferred:
        print("   ", " <-> ".join(c))
    print(f"largest files (top {args.top}):")
    for s in sorted(stats, key=lambda s: -s.lines)[:args.top]:
        print(f"   {s.lines:6d}  {s.path}")
    print(f"largest functions (top {args.top}):")
    funcs = sorted(((n, s.path, name) for s in stats for name, n in s.functions), reverse=True)
    for n, path, name in funcs[:args.top]:
        print(f"   {n:6d}  {path}:{name}")
    if args.verbose:
        print("docstrings of 10+ lines:")
        for path, ln, n in long_docs:
            print(f"   {path}:{ln} ({n} lines)")
        print("lines quoting machines or timings:")
        for path, ln in measures:
            print(f"   {path}:{ln}")
        print("function-level imports between project modules:")
        for mod, ln, target in sorted(local):
            print(f"   {mod}:{ln} -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
