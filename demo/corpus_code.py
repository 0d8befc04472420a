"""The code domain of the demo corpus: the Python standard library sources of the running
interpreter (``sysconfig.get_paths()['stdlib']``, without tests, ``site-packages``, codec
tables and generated data files). Whole files are documents; a seeded ~4% of the files is
held out. Held-out prompts are function headers with their docstring. The functions and
classes found in the files (`Definition`) also feed the chat domain's docstring dialogues."""

from __future__ import annotations

import ast
import inspect
import random
import re
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

_EXCLUDED_DIRS = {
    "site-packages",
    "test",
    "tests",
    "idle_test",
    "encodings",  # mostly generated codec tables
    "pydoc_data",  # one 750 kB generated string
    "__pycache__",
    "turtledemo",
    "__phello__",
    "ensurepip",
}


_MAX_FILE_BYTES = 250_000


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Eligible stdlib source files, sorted by relative path."""
    root = root or stdlib_dir()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if any(part in _EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        name = rel.name
        if (
            name.startswith("test_")
            or name.startswith("_sysconfigdata")
            or rel.parts[0].startswith("config-")
        ):
            continue
        try:
            if p.stat().st_size > _MAX_FILE_BYTES or p.stat().st_size < 200:
                continue
        except OSError:
            continue
        out.append(p)
    return sorted(out, key=lambda p: str(p.relative_to(root)))


def _read_source(p: Path) -> str | None:
    try:
        text = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    text = text.replace("\r\n", "\n").replace("\t", "    ")
    # Drop trailing whitespace on lines; keep everything else verbatim.
    text = "\n".join(line.rstrip() for line in text.split("\n")).strip("\n") + "\n"
    return text


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


@dataclass
class Definition:
    module: str
    qualname: str
    name: str
    kind: str  # "function", "method" or "class"
    args: str
    doc: str  # first paragraph, one line
    source: str | None  # dedented source when short
    header: str  # source lines from the def line to the end of the docstring
    body: str  # up to 12 lines after the docstring


def _first_paragraph(doc: str, limit: int = 320) -> str:
    doc = inspect.cleandoc(doc)
    para = doc.split("\n\n")[0]
    para = " ".join(line.strip() for line in para.splitlines())
    para = re.sub(r"\s+", " ", para).strip()
    if len(para) > limit:
        cut = para[:limit]
        dot = cut.rfind(". ")
        para = cut[: dot + 1] if dot > 80 else cut.rstrip() + " ..."
    return para


def collect_defs(text: str, module: str) -> list[Definition]:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.split("\n")
    out: list[Definition] = []

    def visit(node: ast.AST, prefix: str, in_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if child.name.startswith("_"):
                    continue
                doc = ast.get_docstring(child, clean=False)
                qual = f"{prefix}{child.name}"
                if isinstance(child, ast.ClassDef):
                    kind, args = "class", ""
                    init = next(
                        (
                            n
                            for n in child.body
                            if isinstance(n, ast.FunctionDef) and n.name == "__init__"
                        ),
                        None,
                    )
                    if init is not None:
                        args = ast.unparse(init.args)
                else:
                    kind = "method" if in_class else "function"
                    args = ast.unparse(child.args)
                if doc and len(doc.strip()) >= 12 and child.body:
                    para = _first_paragraph(doc)
                    start = child.lineno - 1
                    doc_end = child.body[0].end_lineno  # the docstring expression
                    end = child.end_lineno
                    header = "\n".join(lines[start:doc_end]) + "\n"
                    body = "\n".join(lines[doc_end : min(end, doc_end + 12)]) + "\n"
                    src = None
                    if not isinstance(child, ast.ClassDef) and end - start <= 16:
                        s = textwrap.dedent("\n".join(lines[start:end]))
                        if len(s) <= 700:
                            src = s
                    # Headers that start with a decorator line are not used as prompts.
                    if not lines[start].lstrip().startswith(("def ", "async def ", "class ")):
                        header = ""
                    out.append(
                        Definition(module, qual, child.name, kind, args, para, src, header, body)
                    )
                if isinstance(child, ast.ClassDef):
                    visit(child, qual + ".", True)

    visit(tree, "", False)
    return out


def build_code(
    rng: random.Random, heldout_frac: float = 0.04, n_prompts: int = 48, n_test: int = 48
):
    """Returns ((train, held-out, dev prompts, test prompts), train_defs, heldout_defs)."""
    root = stdlib_dir()
    files = stdlib_files(root)
    docs: list[tuple[str, str]] = []
    for p in files:
        text = _read_source(p)
        if text is None:
            continue
        docs.append((str(p.relative_to(root)), text))
    order = list(range(len(docs)))
    rng.shuffle(order)
    n_held = max(4, int(len(docs) * heldout_frac))
    held_idx = set(order[:n_held])
    train: list[str] = []
    heldout: list[str] = []
    prompts: list[dict] = []
    test: list[dict] = []
    train_defs: list[Definition] = []
    held_defs: list[Definition] = []
    for i, (rel, text) in enumerate(docs):
        defs = collect_defs(text, _module_name(Path(rel)))
        if i in held_idx:
            heldout.append(text)
            held_defs.extend(defs)
        else:
            train.append(text)
            train_defs.extend(defs)
    # Training documents in a seeded order (the sampler draws windows from the stream).
    rng.shuffle(train)
    # Held-out prompts: function / method headers with their docstring.
    cands = [
        d
        for d in held_defs
        if d.header and d.kind != "class" and d.body.strip() and len(d.header) <= 900
    ]
    rng.shuffle(cands)
    for j, d in enumerate(cands[: n_prompts + n_test]):
        prompt = textwrap.dedent(d.header)
        indent = len(d.header) - len(d.header.lstrip(" "))
        body = "\n".join(
            line[indent:] if line.startswith(" " * indent) else line.lstrip()
            for line in d.body.split("\n")
        )
        split, k = (prompts, j) if j < n_prompts else (test, j - n_prompts)
        tag = "code" if split is prompts else "code-test"
        split.append(
            {"domain": "code", "id": f"{tag}-{k:03d}", "prompt": prompt, "reference": body}
        )
    return (train, heldout, prompts, test), train_defs, held_defs
