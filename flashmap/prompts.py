"""Prompt files: JSONL, one prompt a line, as token ids or as text for the target's tokenizer.

Each line has "prompt_ids" (token ids) or "prompt" (text, encoded with the target checkpoint's
tokenizer, special tokens included as text), and optionally "domain", "id" and "split".

Held-out prompts are split once into dev and test (demo.corpus). The rule: everything that
chooses (checks during training, curves, early stopping, checkpoint, variant and setting picks)
reads dev; reports read test. A prompt file's split travels into the data made from it
(training.drafter_data / generate_data meta.json), and every path that chooses passes that
split through `for_choosing`, which refuses the test prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The held-out prompts of the demo target (code, math, chat), split once: dev for choosing,
# test for reporting.
DEV_PROMPTS = REPO / "demo" / "data" / "dev_prompts.jsonl"
TEST_PROMPTS = REPO / "demo" / "data" / "test_prompts.jsonl"


def prompt_split(path: str | Path) -> str:
    """The split of a prompt file's lines ("dev", "test", "train"...): one name when every
    line carries the same, "mixed:a+b" when they differ, "" when none says."""
    names = set()
    for line in Path(path).read_text().splitlines():
        if line.strip():
            names.add(str(json.loads(line).get("split", "")))
    names.discard("")
    return (
        "" if not names else names.pop() if len(names) == 1 else "mixed:" + "+".join(sorted(names))
    )


def for_choosing(split: str, what: str) -> None:
    """The rule of the held-out split: a path that chooses (`what`) never reads test prompts.
    split: of a prompt file (prompt_split) or of data made from one (its meta.json)."""
    if "test" in str(split).replace("mixed:", "").split("+"):
        raise ValueError(
            f"{what} chooses, and its data come from the test prompts (split {split!r}): "
            f"choices read the dev prompts ({DEV_PROMPTS.relative_to(REPO)}), reports read test"
        )


def read_prompt_lines(
    path: str | Path, target_dir: str | Path | None = None
) -> list[tuple[int, dict, list[int]]]:
    """(line number, record, token ids) per non-empty line of a JSONL prompt file: each line has
    "prompt_ids" (token ids) or "prompt" (text, encoded with the target checkpoint's
    tokenizer, special tokens included as text)."""
    path = Path(path)
    tok = None
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if "prompt_ids" in rec:
            ids = [int(x) for x in rec["prompt_ids"]]
        elif "prompt" in rec:
            if tok is None:
                if target_dir is None:
                    raise ValueError(f"{path}:{n}: text prompts need the target's tokenizer")
                tj = Path(target_dir) / "tokenizer.json"
                if not tj.is_file():
                    raise ValueError(
                        f"{path}:{n}: text prompts need the target's tokenizer ({tj} is missing)"
                    )
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(str(tj))
            ids = tok.encode(rec["prompt"], add_special_tokens=False).ids
        else:
            raise ValueError(f'{path}:{n}: a prompt line needs "prompt_ids" or "prompt"')
        if not ids:
            raise ValueError(f"{path}:{n}: empty prompt")
        out.append((n, rec, ids))
    return out


def read_domain_prompts(path: str | Path, target_dir: str | Path | None) -> list[dict]:
    """[{domain, id, ids}] from a JSONL with "domain" and "prompt" (text, target tokenizer) or
    "prompt_ids" per line (read_prompt_lines)."""
    out = [
        {"domain": str(rec.get("domain", "all")), "id": str(rec.get("id", n)), "ids": ids}
        for n, rec, ids in read_prompt_lines(path, target_dir)
    ]
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out
