"""Training prompts for the drafters: prefixes of the corpus' TRAIN documents.

The target answers them (training/drafter_data.py) and the drafters learn from those
answers (self-distillation). Held-out prompts (demo/data/dev_prompts.jsonl, test_prompts.jsonl) come from
the held-out split, so evaluation never sees these. Code and math prompts are a document cut
at a random line; chat prompts end at an assistant turn's start, so the target writes the
answer.

  python -m demo.drafter_prompts --per-domain 300 --out demo/data/drafter_prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from demo.corpus import DOMAINS, build_corpus

ASSISTANT = "<|im_start|>assistant\n"


def _cut(rng: random.Random, doc: str, domain: str, max_chars: int) -> str | None:
    if domain == "chat":
        starts = [i + len(ASSISTANT) for i in range(len(doc)) if doc.startswith(ASSISTANT, i)]
        return doc[: rng.choice(starts)][-max_chars:] if starts else None
    lines = doc.splitlines(keepends=True)
    if len(lines) < 2:
        return None
    prefix = "".join(lines[: rng.randint(1, len(lines) - 1)])
    return prefix[-max_chars:] if prefix.strip() else None


def make_prompts(
    per_domain: int, seed: int = 0, max_chars: int = 600, max_passes: int = 10
) -> list[dict]:
    corpus = build_corpus(seed=0)  # the corpus the demo target was trained on
    rng = random.Random(seed)
    out = []
    for domain in DOMAINS:
        docs = corpus.domains[domain].train
        picked, seen = 0, set()
        # A domain with fewer documents than prompts wanted (code: one per stdlib file) is cut
        # again at other random points, pass after pass, until the count is reached.
        for _ in range(max_passes):
            for doc in rng.sample(docs, min(len(docs), per_domain * 3)):
                prompt = _cut(rng, doc, domain, max_chars)
                if prompt and prompt not in seen:
                    seen.add(prompt)
                    out.append(
                        {"domain": domain, "id": f"{domain}-train-{picked:05d}", "prompt": prompt}
                    )
                    picked += 1
                    if picked == per_domain:
                        break
            if picked == per_domain:
                break
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--per-domain", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "data" / "drafter_prompts.jsonl",
    )
    a = ap.parse_args(argv)
    prompts = make_prompts(a.per_domain, a.seed)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts))
    print(f"{len(prompts)} prompts -> {a.out}")


if __name__ == "__main__":
    main()
