"""Deterministic local training corpus for the demo target: code, math and chat.

Nothing is downloaded. Three domains, all built from a seed: ``code``
(``demo.corpus_code``: the Python standard library sources of this interpreter),
``math`` (``demo.corpus_math``: generated problems with worked solutions) and ``chat``
(``demo.corpus_chat``: dialogues rendered with the chat template). Each is split into
training documents and held-out documents / prompts.

Held-out prompts (``domain``, ``prompt``, plus ``id``, ``split`` and the held-out
``reference`` continuation) are split once into dev and test and written by
``write_prompt_splits`` to ``demo/data/dev_prompts.jsonl`` (what every choice reads: checks
during training, curves, checkpoint and setting picks) and ``demo/data/test_prompts.jsonl``
(what reports read; flashmap.prompts refuses it to selection paths). Chat prompts end with the generation prompt
(``<|im_start|>assistant\\n``); math prompts end with ``Answer:``; code prompts are a
function header plus its docstring. All prompts end on a pre-tokenizer boundary, so their
tokens are a prefix of the tokens of prompt + reference.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from demo.corpus_chat import build_chat
from demo.corpus_code import build_code, stdlib_dir
from demo.corpus_math import build_math

DOMAINS = ("code", "math", "chat")
DATA = Path(__file__).resolve().parent / "data"
DEV_PROMPTS_PATH, TEST_PROMPTS_PATH = DATA / "dev_prompts.jsonl", DATA / "test_prompts.jsonl"


@dataclass
class Domain:
    name: str
    train: list[str] = field(default_factory=list)
    heldout: list[str] = field(default_factory=list)
    prompts: list[dict] = field(default_factory=list)  # {"domain", "id", "prompt", "reference"}
    test_prompts: list[dict] = field(default_factory=list)  # the same, never used to choose


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


def build_corpus(seed: int = 0, scale: float = 1.0) -> Corpus:
    """Build the three domains deterministically. ``scale`` shrinks generated domains (tests)."""
    rng = random.Random(seed)
    code_rng, math_rng, chat_rng = (random.Random(rng.random()) for _ in range(3))
    code_parts, train_defs, held_defs = build_code(code_rng)
    math_parts = build_math(
        math_rng, n_train=max(100, int(40_000 * scale)), n_heldout=max(60, int(1_500 * scale))
    )
    chat_parts = build_chat(
        chat_rng,
        train_defs if scale >= 1 else train_defs[: max(50, int(len(train_defs) * scale))],
        held_defs,
        n_arith=max(50, int(9_000 * scale)),
        n_word=max(50, int(7_000 * scale)),
        n_code=max(50, int(4_000 * scale)),
        n_small=max(20, int(1_200 * scale)),
    )
    domains = {
        name: Domain(name, *parts)
        for name, parts in zip(DOMAINS, (code_parts, math_parts, chat_parts))
    }
    return Corpus(seed=seed, stdlib=str(stdlib_dir()), domains=domains)


def write_prompt_splits(
    corpus: Corpus, dev: str | Path = DEV_PROMPTS_PATH, test: str | Path = TEST_PROMPTS_PATH
) -> tuple[Path, Path]:
    """The held-out prompts of every domain, dev and test, each record marked with its split."""
    out = []
    for path, split, part in ((dev, "dev", "prompts"), (test, "test", "test_prompts")):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            for name in DOMAINS:
                for p in getattr(corpus.domains[name], part):
                    f.write(json.dumps({**p, "split": split}, ensure_ascii=False) + "\n")
        out.append(path)
    return out[0], out[1]


def load_heldout_prompts(path: str | Path = DEV_PROMPTS_PATH) -> list[dict]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


if __name__ == "__main__":  # pragma: no cover
    import argparse

    ap = argparse.ArgumentParser(
        description="Build the local corpus and write the held-out prompts."
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dev", default=str(DEV_PROMPTS_PATH))
    ap.add_argument("--test", default=str(TEST_PROMPTS_PATH))
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
    print("wrote", *write_prompt_splits(c, args.dev, args.test))
