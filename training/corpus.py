"""Deterministic local training corpus for the demo target: code, math and chat.

Nothing is downloaded. Three domains, all built from a seed:

- ``code``: the Python standard library sources of the running interpreter
  (``sysconfig.get_paths()['stdlib']``, without tests, ``site-packages``, codec tables and
  generated data files). Whole files are documents; a seeded ~4% of the files is held out.
- ``math``: generated problems with worked solutions, formatted as
  ``Question: ...\\nAnswer: ...`` (arithmetic, order of operations, linear equations,
  remainders, percentages and word problems). Held-out problems come from a different
  random stream and never repeat a training question.
- ``chat``: dialogues rendered with the chat template (``training.tokenizer.render_chat``):
  Q/A built from docstrings and sources of stdlib functions and classes (held-out files
  give the held-out dialogues), arithmetic and word problems, small coding tasks, small
  talk. For coding tasks one (task, phrasing) pair per task is reserved for held-out.

Held-out prompts (``domain``, ``prompt``, plus ``id`` and the held-out ``reference``
continuation) are written by ``write_heldout_prompts`` to
``training/data/heldout_prompts.jsonl``. Chat prompts end with the generation prompt
(``<|im_start|>assistant\\n``); math prompts end with ``Answer:``; code prompts are a
function header plus its docstring. All prompts end on a pre-tokenizer boundary, so their
tokens are a prefix of the tokens of prompt + reference.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import random
import re
import sysconfig
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from training.tokenizer import render_chat

DOMAINS = ("code", "math", "chat")
HELDOUT_PROMPTS_PATH = Path(__file__).resolve().parent / "data" / "heldout_prompts.jsonl"

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


@dataclass
class Domain:
    name: str
    train: list[str] = field(default_factory=list)
    heldout: list[str] = field(default_factory=list)
    prompts: list[dict] = field(default_factory=list)  # {"domain", "id", "prompt", "reference"}


@dataclass
class Corpus:
    seed: int
    stdlib: str
    domains: dict[str, Domain]

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for name in DOMAINS:
            d = self.domains[name]
            for part in (d.train, d.heldout):
                for doc in part:
                    h.update(doc.encode("utf-8"))
                    h.update(b"\0")
        return h.hexdigest()[:16]

    def stats(self) -> dict:
        return {
            name: {
                "train_docs": len(d.train),
                "train_chars": sum(map(len, d.train)),
                "heldout_docs": len(d.heldout),
                "heldout_chars": sum(map(len, d.heldout)),
                "prompts": len(d.prompts),
            }
            for name, d in self.domains.items()
        }


# --------------------------------------------------------------------------- code


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
class _Def:
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


def _collect_defs(text: str, module: str) -> list[_Def]:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.split("\n")
    out: list[_Def] = []

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
                    out.append(_Def(module, qual, child.name, kind, args, para, src, header, body))
                if isinstance(child, ast.ClassDef):
                    visit(child, qual + ".", True)

    visit(tree, "", False)
    return out


def build_code(rng: random.Random, heldout_frac: float = 0.04, n_prompts: int = 48):
    """Returns (Domain, train_defs, heldout_defs)."""
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
    dom = Domain("code")
    train_defs: list[_Def] = []
    held_defs: list[_Def] = []
    for i, (rel, text) in enumerate(docs):
        defs = _collect_defs(text, _module_name(Path(rel)))
        if i in held_idx:
            dom.heldout.append(text)
            held_defs.extend(defs)
        else:
            dom.train.append(text)
            train_defs.extend(defs)
    # Training documents in a seeded order (the sampler draws windows from the stream).
    rng.shuffle(dom.train)
    # Held-out prompts: function / method headers with their docstring.
    cands = [
        d
        for d in held_defs
        if d.header and d.kind != "class" and d.body.strip() and len(d.header) <= 900
    ]
    rng.shuffle(cands)
    for j, d in enumerate(cands[:n_prompts]):
        prompt = textwrap.dedent(d.header)
        indent = len(d.header) - len(d.header.lstrip(" "))
        body = "\n".join(
            line[indent:] if line.startswith(" " * indent) else line.lstrip()
            for line in d.body.split("\n")
        )
        dom.prompts.append(
            {"domain": "code", "id": f"code-{j:03d}", "prompt": prompt, "reference": body}
        )
    return dom, train_defs, held_defs


# --------------------------------------------------------------------------- math

_NAMES = [
    ("Alice", "she", "her"),
    ("Bob", "he", "his"),
    ("Carol", "she", "her"),
    ("David", "he", "his"),
    ("Emma", "she", "her"),
    ("Frank", "he", "his"),
    ("Grace", "she", "her"),
    ("Henry", "he", "his"),
    ("Ivy", "she", "her"),
    ("Jack", "he", "his"),
    ("Kate", "she", "her"),
    ("Leo", "he", "his"),
    ("Mia", "she", "her"),
    ("Noah", "he", "his"),
    ("Olivia", "she", "her"),
    ("Paul", "he", "his"),
    ("Rosa", "she", "her"),
    ("Sam", "he", "his"),
    ("Tina", "she", "her"),
    ("Victor", "he", "his"),
]
_ITEMS = [
    "apples",
    "oranges",
    "pencils",
    "books",
    "marbles",
    "stickers",
    "cookies",
    "cards",
    "coins",
    "flowers",
    "eggs",
    "stamps",
    "shells",
    "candies",
    "balloons",
    "toy cars",
]
_THINGS = [
    ("notebook", "notebooks"),
    ("pen", "pens"),
    ("ticket", "tickets"),
    ("sandwich", "sandwiches"),
    ("bottle of water", "bottles of water"),
    ("book", "books"),
    ("ball", "balls"),
    ("cup of tea", "cups of tea"),
]
_CONTAINERS = ["boxes", "bags", "baskets", "jars", "shelves", "rows", "packs", "crates"]


def _n(rng: random.Random, lo: int, hi: int) -> int:
    return rng.randint(lo, hi)


def _num(rng: random.Random) -> int:
    """A number of 1 to 3 digits, mostly small."""
    r = rng.random()
    if r < 0.45:
        return _n(rng, 1, 20)
    if r < 0.85:
        return _n(rng, 10, 99)
    return _n(rng, 100, 999)


def _mul_steps(a: int, b: int) -> str:
    """Worked multiplication of a (2-3 digits) by b (1 digit)."""
    parts = []
    s = str(a)
    for i, ch in enumerate(s):
        place = 10 ** (len(s) - 1 - i)
        if ch != "0":
            parts.append(int(ch) * place)
    if len(parts) < 2:
        return f"{a} * {b} = {a * b}"
    terms = " + ".join(f"{p} * {b}" for p in parts)
    prods = " + ".join(str(p * b) for p in parts)
    return f"{a} * {b} = {terms} = {prods} = {a * b}"


def math_problem(rng: random.Random) -> tuple[str, str]:
    """One (question, worked answer) pair."""
    kind = rng.choices(
        ["add", "sub", "mul", "div", "paren", "prec", "eq", "rem", "pct", "cmp", "sq", "word"],
        weights=[10, 9, 10, 6, 6, 5, 6, 4, 3, 3, 3, 35],
    )[0]
    if kind == "add":
        a, b = _num(rng), _num(rng)
        q = rng.choice(
            [
                f"What is {a} + {b}?",
                f"Compute {a} + {b}.",
                f"What is the sum of {a} and {b}?",
                f"Add {a} and {b}.",
            ]
        )
        return q, f"{a} + {b} = {a + b}. The answer is {a + b}."
    if kind == "sub":
        a, b = _num(rng), _num(rng)
        a, b = max(a, b), min(a, b)
        q = rng.choice(
            [
                f"What is {a} - {b}?",
                f"Compute {a} - {b}.",
                f"Subtract {b} from {a}.",
                f"What is {a} minus {b}?",
            ]
        )
        return q, f"{a} - {b} = {a - b}. The answer is {a - b}."
    if kind == "mul":
        if rng.random() < 0.6:
            a, b = _n(rng, 2, 12), _n(rng, 2, 12)
            q = rng.choice(
                [
                    f"What is {a} * {b}?",
                    f"What is {a} times {b}?",
                    f"Compute {a} * {b}.",
                    f"Multiply {a} by {b}.",
                ]
            )
            return q, f"{a} * {b} = {a * b}. The answer is {a * b}."
        a, b = _n(rng, 11, 399), _n(rng, 2, 9)
        q = rng.choice([f"What is {a} * {b}?", f"Compute {a} * {b}.", f"Multiply {a} by {b}."])
        return q, f"{_mul_steps(a, b)}. The answer is {a * b}."
    if kind == "div":
        b, c = _n(rng, 2, 12), _n(rng, 2, 25)
        a = b * c
        q = rng.choice(
            [f"What is {a} / {b}?", f"Divide {a} by {b}.", f"What is {a} divided by {b}?"]
        )
        return q, f"{a} / {b} = {c}, because {b} * {c} = {a}. The answer is {c}."
    if kind == "paren":
        a, b, c = _num(rng) % 50 + 1, _num(rng) % 50 + 1, _n(rng, 2, 9)
        if rng.random() < 0.5:
            s = a + b
            return (
                f"Compute ({a} + {b}) * {c}.",
                f"First, {a} + {b} = {s}. Then, {s} * {c} = {s * c}. The answer is {s * c}.",
            )
        a, b = max(a, b), min(a, b)
        s = a - b
        return (
            f"Compute ({a} - {b}) * {c}.",
            f"First, {a} - {b} = {s}. Then, {s} * {c} = {s * c}. The answer is {s * c}.",
        )
    if kind == "prec":
        a, b, c = _n(rng, 1, 60), _n(rng, 2, 12), _n(rng, 2, 12)
        p = b * c
        return (
            f"What is {a} + {b} * {c}?",
            f"Multiplication comes first: {b} * {c} = {p}. Then, {a} + {p} = {a + p}. The answer is {a + p}.",
        )
    if kind == "eq":
        a, x, b = _n(rng, 2, 9), _n(rng, 1, 20), _n(rng, 1, 40)
        c = a * x + b
        return (
            f"Solve for x: {a}x + {b} = {c}.",
            f"Subtract {b} from both sides: {a}x = {c - b}. Divide both sides by {a}: x = {x}. The answer is x = {x}.",
        )
    if kind == "rem":
        b = _n(rng, 2, 12)
        a = _n(rng, b + 1, 150)
        qt, r = divmod(a, b)
        return (
            f"What is the remainder when {a} is divided by {b}?",
            f"{a} = {b} * {qt} + {r}, so the remainder is {r}. The answer is {r}.",
        )
    if kind == "pct":
        p = rng.choice([10, 20, 25, 50, 75])
        n = rng.choice([20, 40, 60, 80, 100, 120, 200, 240, 300, 400, 500, 800])
        r = n * p // 100
        return f"What is {p}% of {n}?", f"{p}% of {n} is {n} * {p} / 100 = {r}. The answer is {r}."
    if kind == "cmp":
        a, b = _num(rng), _num(rng)
        while b == a:
            b = _num(rng)
        big = max(a, b)
        return (
            f"Which is larger, {a} or {b}?",
            f"{big} is larger, because {big} - {min(a, b)} = {big - min(a, b)} is positive. The answer is {big}.",
        )
    if kind == "sq":
        a = _n(rng, 2, 25)
        return (
            f"What is the square of {a}?",
            f"The square of {a} is {a} * {a} = {a * a}. The answer is {a * a}.",
        )
    return word_problem(rng)


def word_problem(rng: random.Random) -> tuple[str, str]:
    name, he, his = rng.choice(_NAMES)
    friend = rng.choice([n for n in _NAMES if n[0] != name])[0]
    item = rng.choice(_ITEMS)
    He = he.capitalize()
    kind = rng.randrange(10)
    if kind == 0:
        a, b = _n(rng, 2, 60), _n(rng, 2, 40)
        return (
            f"{name} has {a} {item}. {He} buys {b} more. How many {item} does {he} have now?",
            f"{name} starts with {a} {item} and buys {b} more, so {he} has {a} + {b} = {a + b} {item}. The answer is {a + b}.",
        )
    if kind == 1:
        a = _n(rng, 10, 90)
        b = _n(rng, 1, a - 1)
        return (
            f"{name} has {a} {item} and gives {b} of them to {friend}. How many {item} does {name} have left?",
            f"{name} gives away {b} of {his} {a} {item}, so {a} - {b} = {a - b} {item} are left. The answer is {a - b}.",
        )
    if kind == 2:
        a, b = _n(rng, 2, 12), _n(rng, 2, 15)
        box = rng.choice(_CONTAINERS)
        return (
            f"There are {a} {box} with {b} {item} in each. How many {item} are there in total?",
            f"Each of the {a} {box} holds {b} {item}, so there are {a} * {b} = {a * b} {item}. The answer is {a * b}.",
        )
    if kind == 3:
        b, c = _n(rng, 2, 10), _n(rng, 2, 12)
        a = b * c
        return (
            f"{name} shares {a} {item} equally among {b} friends. How many {item} does each friend get?",
            f"{a} {item} shared among {b} friends gives {a} / {b} = {c} {item} each. The answer is {c}.",
        )
    if kind == 4:
        thing, things = rng.choice(_THINGS)
        p, n = _n(rng, 2, 15), _n(rng, 2, 9)
        return (
            f"One {thing} costs {p} dollars. How much do {n} {things} cost?",
            f"{n} {things} cost {n} * {p} = {n * p} dollars. The answer is {n * p}.",
        )
    if kind == 5:
        thing, things = rng.choice(_THINGS)
        p, n = _n(rng, 2, 9), _n(rng, 2, 6)
        cost = p * n
        bill = next(b for b in (10, 20, 50, 100) if b > cost)
        return (
            f"{name} buys {n} {things} at {p} dollars each and pays with a {bill}-dollar bill. How much change does {he} get?",
            f"The {things} cost {n} * {p} = {cost} dollars. The change is {bill} - {cost} = {bill - cost} dollars. The answer is {bill - cost}.",
        )
    if kind == 6:
        s, h = rng.choice([30, 40, 45, 50, 60, 70, 80, 90, 100, 120]), _n(rng, 2, 6)
        vehicle = rng.choice(["train", "car", "bus", "truck"])
        return (
            f"A {vehicle} travels at {s} km per hour for {h} hours. How far does it travel?",
            f"Distance is speed times time: {s} * {h} = {s * h} km. The answer is {s * h}.",
        )
    if kind == 7:
        a, b, c = _n(rng, 5, 40), _n(rng, 1, 15), _n(rng, 1, 10)
        return (
            f"{name} is {a} years old. {friend} is {b} years older than {name}. How old will {friend} be in {c} years?",
            f"{friend} is {a} + {b} = {a + b} years old now. In {c} years {friend} will be {a + b} + {c} = {a + b + c}. The answer is {a + b + c}.",
        )
    if kind == 8:
        w, h = _n(rng, 2, 20), _n(rng, 2, 20)
        if rng.random() < 0.5:
            return (
                f"A rectangle is {w} cm wide and {h} cm long. What is its area?",
                f"The area is width times length: {w} * {h} = {w * h} square cm. The answer is {w * h}.",
            )
        return (
            f"A rectangle is {w} cm wide and {h} cm long. What is its perimeter?",
            f"The perimeter is 2 * ({w} + {h}) = 2 * {w + h} = {2 * (w + h)} cm. The answer is {2 * (w + h)}.",
        )
    a, b, c = _n(rng, 2, 30), _n(rng, 2, 5), _n(rng, 2, 10)
    total = a + b * c
    d = _n(rng, 1, total - 1)
    box = rng.choice(["packs", "bags", "boxes"])
    return (
        f"{name} has {a} {item}. {He} buys {b} {box} with {c} {item} in each, then gives {d} {item} to {friend}. How many {item} does {name} have now?",
        f"The {box} hold {b} * {c} = {b * c} {item}. Then {name} has {a} + {b * c} = {total} {item}. "
        f"After giving away {d}, {he} has {total} - {d} = {total - d}. The answer is {total - d}.",
    )


def format_math(q: str, a: str) -> str:
    return f"Question: {q}\nAnswer: {a}"


def build_math(
    rng: random.Random, n_train: int = 40_000, n_heldout: int = 1_500, n_prompts: int = 48
) -> Domain:
    dom = Domain("math")
    seen: set[str] = set()
    for _ in range(n_train):
        q, a = math_problem(rng)
        seen.add(q)
        dom.train.append(format_math(q, a))
    held_rng = random.Random(rng.random())
    while len(dom.heldout) < n_heldout:
        q, a = math_problem(held_rng)
        if q in seen:
            continue
        seen.add(q)
        dom.heldout.append(format_math(q, a))
        if len(dom.prompts) < n_prompts:
            dom.prompts.append(
                {
                    "domain": "math",
                    "id": f"math-{len(dom.prompts):03d}",
                    "prompt": f"Question: {q}\nAnswer:",
                    "reference": f" {a}",
                }
            )
    return dom


# --------------------------------------------------------------------------- chat

_SYSTEMS = [
    None,
    None,
    None,
    "You are a helpful assistant.",
    "You are a Python expert.",
    "You are a patient math tutor.",
    "You are a concise assistant. Answer briefly.",
]


def _docstring_dialogue(rng: random.Random, d: _Def) -> list[dict]:
    full = f"{d.module}.{d.qualname}"
    kind = d.kind
    choice = rng.random()
    if d.source and choice < 0.25:
        q = rng.choice(
            [
                f"Show me the implementation of {full}.",
                f"How is `{full}` implemented?",
                f"Can you show the source code of {full}?",
            ]
        )
        a = f"Here is the source of `{d.qualname}` from the `{d.module}` module:\n\n```python\n{d.source}\n```"
        return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    if kind != "class" and choice < 0.4:
        q = rng.choice([f"What arguments does {full} take?", f"What is the signature of `{full}`?"])
        a = f"`{d.qualname}` is defined in `{d.module}` as:\n\n```python\ndef {d.name}({d.args}):\n```\n\n{d.doc}"
        return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    q = rng.choice(
        [
            f"What does `{full}` do?",
            f"What does {full} do?",
            f"Explain the {kind} {d.qualname} in the {d.module} module.",
            f"Can you describe {full}?",
            f"What is `{d.qualname}` used for in {d.module}?",
            f"I found `{full}` in the standard library. What is it for?",
        ]
    )
    sig = f"{d.qualname}({d.args})"
    a = rng.choice(
        [
            f"`{d.module}.{sig}`: {d.doc}",
            f"In the `{d.module}` module, `{d.qualname}` is a {kind}. {d.doc}",
            f"The {kind} `{sig}` from `{d.module}`. Its documentation says: {d.doc}",
        ]
    )
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


_OPS = {
    "+": ("plus", lambda a, b: a + b),
    "-": ("minus", lambda a, b: a - b),
    "*": ("times", lambda a, b: a * b),
}


def _arith_dialogue(rng: random.Random) -> list[dict]:
    op = rng.choice(["+", "-", "*"])
    if op == "*":
        a, b = _n(rng, 2, 30), _n(rng, 2, 12)
    else:
        a, b = _num(rng), _num(rng)
        if op == "-":
            a, b = max(a, b), min(a, b)
    word, f = _OPS[op]
    c = f(a, b)
    q = rng.choice(
        [
            f"What is {a} {op} {b}?",
            f"Can you compute {a} {op} {b}?",
            f"Please calculate {a} {op} {b}.",
            f"How much is {a} {word} {b}?",
            f"{a} {op} {b} = ?",
        ]
    )
    ans = rng.choice(
        [
            f"{a} {op} {b} = {c}.",
            f"Sure! {a} {op} {b} = {c}.",
            f"The result is {c}, since {a} {op} {b} = {c}.",
        ]
    )
    msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]
    if rng.random() < 0.35:
        op2 = rng.choice(["+", "*"])
        d = _n(rng, 2, 20) if op2 == "+" else _n(rng, 2, 5)
        f2 = _OPS[op2][1]
        e = f2(c, d)
        if op2 == "+":
            q2 = rng.choice([f"Now add {d} to that.", f"And if we add {d}?"])
        else:
            q2 = rng.choice([f"Now multiply that by {d}.", f"And if we multiply by {d}?"])
        msgs += [
            {"role": "user", "content": q2},
            {"role": "assistant", "content": f"{c} {op2} {d} = {e}."},
        ]
    return msgs


def _word_dialogue(rng: random.Random) -> list[dict]:
    q, a = math_problem(rng) if rng.random() < 0.3 else word_problem(rng)
    if rng.random() < 0.3:
        q = (
            rng.choice(["Can you help me with this problem? ", "Please solve: ", "Math question: "])
            + q
        )
    a = rng.choice(["", "Let's work it out step by step. ", "Step by step: "]) + a
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


# (description as "a function that ...", infinitive "to ...", function name, code, note)
_CODE_TASKS = [
    (
        "returns the sum of a list of numbers",
        "add up the numbers in a list",
        "total",
        "def total(numbers):\n    result = 0\n    for x in numbers:\n        result += x\n    return result",
        "The built-in `sum(numbers)` does the same thing.",
    ),
    (
        "returns the largest number in a list",
        "find the maximum of a list",
        "largest",
        "def largest(numbers):\n    best = numbers[0]\n    for x in numbers[1:]:\n        if x > best:\n            best = x\n    return best",
        "The built-in `max(numbers)` does the same thing.",
    ),
    (
        "returns the smallest number in a list",
        "find the minimum of a list",
        "smallest",
        "def smallest(numbers):\n    best = numbers[0]\n    for x in numbers[1:]:\n        if x < best:\n            best = x\n    return best",
        "The built-in `min(numbers)` does the same thing.",
    ),
    (
        "checks whether a number is even",
        "check if a number is even",
        "is_even",
        "def is_even(n):\n    return n % 2 == 0",
        "A number is even when the remainder of division by 2 is zero.",
    ),
    (
        "checks whether a number is prime",
        "test if a number is prime",
        "is_prime",
        "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n        if n % i == 0:\n            return False\n        i += 1\n    return True",
        "It only tries divisors up to the square root of `n`.",
    ),
    (
        "reverses a string",
        "reverse a string",
        "reverse",
        "def reverse(text):\n    return text[::-1]",
        "The slice `[::-1]` walks the string backwards.",
    ),
    (
        "checks whether a string is a palindrome",
        "check if a string is a palindrome",
        "is_palindrome",
        "def is_palindrome(text):\n    text = text.lower()\n    return text == text[::-1]",
        "A palindrome reads the same forwards and backwards.",
    ),
    (
        "counts the vowels in a string",
        "count the vowels in a string",
        "count_vowels",
        'def count_vowels(text):\n    return sum(1 for ch in text.lower() if ch in "aeiou")',
        "It checks each character against the string of vowels.",
    ),
    (
        "computes the factorial of n",
        "compute a factorial",
        "factorial",
        "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result",
        "`math.factorial(n)` from the standard library does the same thing.",
    ),
    (
        "returns the n-th Fibonacci number",
        "compute Fibonacci numbers",
        "fibonacci",
        "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
        "It keeps the last two numbers of the sequence.",
    ),
    (
        "converts Celsius to Fahrenheit",
        "convert Celsius to Fahrenheit",
        "celsius_to_fahrenheit",
        "def celsius_to_fahrenheit(celsius):\n    return celsius * 9 / 5 + 32",
        "For example, 100 degrees Celsius is 212 degrees Fahrenheit.",
    ),
    (
        "removes duplicates from a list while keeping the order",
        "remove duplicates from a list",
        "unique",
        "def unique(items):\n    seen = set()\n    result = []\n    for item in items:\n        if item not in seen:\n            seen.add(item)\n            result.append(item)\n    return result",
        "The set makes each membership test fast.",
    ),
    (
        "counts how often each word appears in a text",
        "count words in a text",
        "word_counts",
        "def word_counts(text):\n    counts = {}\n    for word in text.split():\n        counts[word] = counts.get(word, 0) + 1\n    return counts",
        "`collections.Counter(text.split())` does the same thing.",
    ),
    (
        "flattens a list of lists",
        "flatten a nested list",
        "flatten",
        "def flatten(lists):\n    result = []\n    for inner in lists:\n        result.extend(inner)\n    return result",
        "It extends the result with each inner list.",
    ),
    (
        "returns the average of a list of numbers",
        "compute the mean of a list",
        "average",
        'def average(numbers):\n    if not numbers:\n        raise ValueError("empty list")\n    return sum(numbers) / len(numbers)',
        "`statistics.mean(numbers)` does the same thing.",
    ),
    (
        "reads a text file and returns its lines",
        "read the lines of a file",
        "read_lines",
        'def read_lines(path):\n    with open(path, encoding="utf-8") as f:\n        return f.read().splitlines()',
        "The `with` statement closes the file when the block ends.",
    ),
    (
        "merges two dictionaries",
        "merge two dictionaries",
        "merge",
        "def merge(a, b):\n    result = dict(a)\n    result.update(b)\n    return result",
        "Keys from `b` win when both dictionaries have them.",
    ),
    (
        "squares every number in a list",
        "square each element of a list",
        "squares",
        "def squares(numbers):\n    return [x * x for x in numbers]",
        "A list comprehension builds the new list.",
    ),
    (
        "returns the even numbers of a list",
        "keep only the even numbers",
        "evens",
        "def evens(numbers):\n    return [x for x in numbers if x % 2 == 0]",
        "The condition filters the list.",
    ),
    (
        "computes the greatest common divisor of two numbers",
        "compute a greatest common divisor",
        "gcd",
        "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a",
        "This is Euclid's algorithm; `math.gcd` does the same thing.",
    ),
    (
        "counts the lines in a file",
        "count lines in a file",
        "count_lines",
        'def count_lines(path):\n    with open(path, encoding="utf-8") as f:\n        return sum(1 for _ in f)',
        "Iterating over a file yields one line at a time.",
    ),
    (
        "capitalizes every word in a sentence",
        "capitalize each word",
        "title_case",
        'def title_case(sentence):\n    return " ".join(word.capitalize() for word in sentence.split())',
        "`str.title()` is similar but treats apostrophes differently.",
    ),
    (
        "sorts a list of words by length",
        "sort words by their length",
        "sort_by_length",
        "def sort_by_length(words):\n    return sorted(words, key=len)",
        "The `key` argument tells `sorted` what to compare.",
    ),
    (
        "returns the last n items of a list",
        "get the last n elements of a list",
        "last_items",
        "def last_items(items, n):\n    if n <= 0:\n        return []\n    return items[-n:]",
        "Negative slice indices count from the end.",
    ),
]
_CODE_PATTERNS = [
    "Write a Python function that {desc}.",
    "How do I {inf} in Python?",
    "Can you write code to {inf}?",
    "Show me a function that {desc}.",
    "I need a Python function that {desc}. Can you help?",
]


def _code_dialogue(task: tuple, pattern: str, rng: random.Random) -> list[dict]:
    desc, inf, name, code, note = task
    q = pattern.format(desc=desc, inf=inf)
    intro = rng.choice(
        [
            f"Here is a function that {desc}:",
            "Sure, here is one way to do it:",
            f"You can use a function like `{name}`:",
        ]
    )
    a = f"{intro}\n\n```python\n{code}\n```\n\n{note}"
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


_SMALLTALK = [
    (
        ["Hello!", "Hi!", "Hi there.", "Hello, how are you?", "Good morning!", "Hey!"],
        [
            "Hello! How can I help you today?",
            "Hi! What can I do for you?",
            "Hello! I can help with Python code and arithmetic.",
        ],
    ),
    (
        ["Who are you?", "What are you?", "What is your name?", "Tell me about yourself."],
        [
            "I am a small language model trained for the FlashMap Serve demo. I can talk about Python code and arithmetic.",
            "I am a tiny demo assistant. I was trained on Python source code, math problems and short dialogues.",
        ],
    ),
    (
        ["What can you do?", "How can you help me?", "What are you good at?"],
        [
            "I can explain functions from the Python standard library, write small Python functions, and solve arithmetic and word problems step by step."
        ],
    ),
    (
        ["Thank you!", "Thanks.", "Thanks a lot!", "Great, thank you."],
        [
            "You're welcome!",
            "Glad I could help!",
            "You're welcome. Let me know if you have another question.",
        ],
    ),
    (["Bye!", "Goodbye.", "See you later."], ["Goodbye!", "Bye! Have a nice day."]),
]


def _smalltalk_dialogue(rng: random.Random) -> list[dict]:
    qs, answers = rng.choice(_SMALLTALK)
    return [
        {"role": "user", "content": rng.choice(qs)},
        {"role": "assistant", "content": rng.choice(answers)},
    ]


def _with_system(rng: random.Random, msgs: list[dict]) -> list[dict]:
    sysmsg = rng.choice(_SYSTEMS)
    return ([{"role": "system", "content": sysmsg}] if sysmsg else []) + msgs


def _chat_prompt(msgs: list[dict]) -> tuple[str, str]:
    """Prompt = everything up to the last assistant turn + generation prompt; reference = that turn."""
    assert msgs[-1]["role"] == "assistant"
    return render_chat(msgs[:-1], add_generation_prompt=True), msgs[-1]["content"] + "<|im_end|>"


def build_chat(
    rng: random.Random,
    train_defs: list,
    held_defs: list,
    n_arith: int = 9_000,
    n_word: int = 7_000,
    n_code: int = 4_000,
    n_small: int = 1_200,
    n_prompts: int = 48,
) -> Domain:
    dom = Domain("chat")
    # Reserve one phrasing per coding task for held-out.
    reserved = {i: rng.randrange(len(_CODE_PATTERNS)) for i in range(len(_CODE_TASKS))}
    dialogues: list[list[dict]] = []
    for d in train_defs:
        dialogues.append(_docstring_dialogue(rng, d))
    for _ in range(n_arith):
        dialogues.append(_arith_dialogue(rng))
    for _ in range(n_word):
        dialogues.append(_word_dialogue(rng))
    for _ in range(n_code):
        ti = rng.randrange(len(_CODE_TASKS))
        pi = rng.choice([p for p in range(len(_CODE_PATTERNS)) if p != reserved[ti]])
        dialogues.append(_code_dialogue(_CODE_TASKS[ti], _CODE_PATTERNS[pi], rng))
    for _ in range(n_small):
        dialogues.append(_smalltalk_dialogue(rng))
    rng.shuffle(dialogues)
    dom.train = [render_chat(_with_system(rng, m)) for m in dialogues]
    train_set = set(dom.train)

    # Held-out: docstrings of held-out files, fresh arithmetic / word problems, reserved
    # coding phrasings, small talk (the small-talk bank is shared with training).
    held_rng = random.Random(rng.random())
    held: list[tuple[str, list[dict]]] = []
    defs = list(held_defs)
    held_rng.shuffle(defs)
    held += [("docstring", _docstring_dialogue(held_rng, d)) for d in defs[:600]]
    held += [("arith", _arith_dialogue(held_rng)) for _ in range(300)]
    held += [("word", _word_dialogue(held_rng)) for _ in range(300)]
    held += [
        ("code_task", _code_dialogue(_CODE_TASKS[i], _CODE_PATTERNS[reserved[i]], held_rng))
        for i in range(len(_CODE_TASKS))
    ]
    held += [("smalltalk", _smalltalk_dialogue(held_rng)) for _ in range(20)]
    held = [(k, _with_system(held_rng, m)) for k, m in held]
    held = [(k, m) for k, m in held if render_chat(m) not in train_set]
    dom.heldout = [render_chat(m) for _, m in held]
    # Prompts: a fixed mix of kinds, each in seeded order.
    quota = {"docstring": 16, "arith": 8, "word": 10, "code_task": 10, "smalltalk": 4}
    scale = n_prompts / sum(quota.values())
    picked: list[tuple[str, list[dict]]] = []
    for kind, k in quota.items():
        items = [x for x in held if x[0] == kind]
        picked += items[: max(1, round(k * scale))]
    for j, (kind, m) in enumerate(picked):
        prompt, ref = _chat_prompt(m)
        dom.prompts.append(
            {
                "domain": "chat",
                "id": f"chat-{j:03d}",
                "kind": kind,
                "prompt": prompt,
                "reference": ref,
            }
        )
    return dom


# --------------------------------------------------------------------------- all


def build_corpus(seed: int = 0, scale: float = 1.0) -> Corpus:
    """Build the three domains deterministically. ``scale`` shrinks generated domains (tests)."""
    rng = random.Random(seed)
    code_rng, math_rng, chat_rng = (random.Random(rng.random()) for _ in range(3))
    code, train_defs, held_defs = build_code(code_rng)
    math_dom = build_math(
        math_rng, n_train=max(100, int(40_000 * scale)), n_heldout=max(60, int(1_500 * scale))
    )
    chat = build_chat(
        chat_rng,
        train_defs if scale >= 1 else train_defs[: max(50, int(len(train_defs) * scale))],
        held_defs,
        n_arith=max(50, int(9_000 * scale)),
        n_word=max(50, int(7_000 * scale)),
        n_code=max(50, int(4_000 * scale)),
        n_small=max(20, int(1_200 * scale)),
    )
    return Corpus(
        seed=seed, stdlib=str(stdlib_dir()), domains={"code": code, "math": math_dom, "chat": chat}
    )


def write_heldout_prompts(corpus: Corpus, path: str | Path = HELDOUT_PROMPTS_PATH) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for name in DOMAINS:
            for p in corpus.domains[name].prompts:
                f.write(json.dumps(p, ensure_ascii=False) + "\n")
    return path


def load_heldout_prompts(path: str | Path = HELDOUT_PROMPTS_PATH) -> list[dict]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


if __name__ == "__main__":  # pragma: no cover
    import argparse

    ap = argparse.ArgumentParser(
        description="Build the local corpus and write the held-out prompts."
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", default=str(HELDOUT_PROMPTS_PATH))
    ap.add_argument("--show", type=int, default=1, help="print this many examples per domain")
    args = ap.parse_args()
    c = build_corpus(args.seed)
    print(json.dumps(c.stats(), indent=2))
    print("fingerprint", c.fingerprint())
    for name in DOMAINS:
        for doc in c.domains[name].train[: args.show]:
            print(f"----- {name}\n{doc[:800]}")
        for p in c.domains[name].prompts[: args.show]:
            print(f"----- {name} prompt\n{p['prompt']}\n----- reference\n{p['reference'][:400]}")
    print("wrote", write_heldout_prompts(c, args.prompts))
