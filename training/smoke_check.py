"""The two ends of scripts/train-smoke.sh, the drafter-training chain on a tiny random Qwen3:

  python -m training.smoke_check world DIR
      DIR/target (a random Qwen3 with a tokenizer, target_service.random_checkpoint),
      DIR/prompts.jsonl and DIR/heldout.jsonl (text prompts cut from the tokenizer's text)
  python -m training.smoke_check served --target DIR/target --url HOST:PORT --prompts P [--prompts Q]
      the running stack's greedy output for the first --n prompts of each file against the
      target alone (TargetEngine, autoregressive): exit 1 on any difference, or when no
      drafted token was accepted (a check of exactness that never accepts a draft proves little).

A random target's greedy text has no structure a drafter can learn in a few CPU steps, so the
smoke trains on few prompts (12), which the drafter learns by heart: served on those, its
drafts are accepted; on held-out prompts, rejected. Both paths must give the target's text.

Prompts whose reference passes a near-tie (top-2 logit gap under --min-gap in fp32, from
transformers' Qwen3) are left out: there a verify pass and a one-token step may round to
different argmaxes, which is not a defect of the stack.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path


def make_world(out: str | Path, n_train: int = 12, n_heldout: int = 6, seed: int = 0) -> Path:
    from target_service.random_checkpoint import TOKENIZER_TEXT, make_random_qwen3

    out = Path(out)
    # 8 layers: 5 feature layers (1..5), as a real Qwen3's 36 give 5, so the features (5 x 64)
    # are wider than the smoke's drafter (64): drafter_service tells raw from projected
    # context by width.
    make_random_qwen3(out / "target", num_hidden_layers=8)
    lines = [ln for ln in TOKENIZER_TEXT.splitlines() if len(ln.split()) > 4]
    rng = random.Random(seed)

    def cut(line: str) -> str:
        words = line.split()
        return " ".join(words[: rng.randint(3, len(words) - 1)])

    for name, n in (("prompts.jsonl", n_train), ("heldout.jsonl", n_heldout)):
        with open(out / name, "w") as f:
            for _ in range(n):
                f.write(json.dumps({"prompt": cut(rng.choice(lines))}) + "\n")
    return out


def reference(target: str | Path, prompts: list[list[int]], max_new: int):
    """(greedy continuations of the target alone, smallest top-2 logit gap along each)."""
    import torch
    from transformers import Qwen3ForCausalLM

    from flashmap.inprocess import decode
    from flashmap.types import GenerationRequest, SamplingParams
    from target_service.engine import TargetEngine

    engine = TargetEngine(target, n_slots=4, max_seq_len=len(max(prompts, key=len)) + max_new + 1)
    res = decode(engine, [GenerationRequest(p, max_new, SamplingParams()) for p in prompts])
    hf = Qwen3ForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    gaps = []
    for p, r in zip(prompts, res):
        with torch.no_grad():
            logits = hf(torch.tensor([p + r.token_ids])).logits[0, len(p) - 1 : -1]
        top = logits.topk(2, -1).values
        gaps.append(float((top[:, 0] - top[:, 1]).min()))
    return [r.token_ids for r in res], gaps


def check_served(
    target: str | Path, url: str, prompts: list[list[int]], max_new: int, min_gap: float
) -> int:
    from flashmap.client import Client

    want, gaps = reference(target, prompts, max_new)
    bad, drafts, accepted, used = 0, 0, 0, 0
    with Client(url, timeout=120) as c:
        for i, (p, w, g) in enumerate(zip(prompts, want, gaps)):
            if g < min_gap:
                print(f"  prompt {i}: skipped (near-tie in the reference, top-2 gap {g:.1e})")
                continue
            r = c.generate(prompt_ids=p, max_new_tokens=max_new, ignore_eos=True, temperature=0)
            same = list(r.token_ids) == w
            used += 1
            bad += not same
            drafts += r.stats.drafts
            accepted += r.stats.accepted
            print(
                f"  prompt {i}: {'same as the target alone' if same else 'DIFFERS'} "
                f"({len(w)} tokens, {r.stats.drafts} drafted rounds, {r.stats.accepted} draft "
                f"tokens accepted)"
            )
    print(
        f"served == target alone on {used - bad} of {used} prompts; {drafts} drafted rounds, "
        f"{accepted} draft tokens accepted"
    )
    if used == 0 or bad or accepted == 0:
        why = "no prompt checked" if used == 0 else "outputs differ" if bad else "no draft accepted"
        print(f"FAILED: {why}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m training.smoke_check", description=__doc__.split("\n\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("world", help="a tiny random Qwen3 and prompt files")
    w.add_argument("out")
    s = sub.add_parser("served", help="the stack's greedy output == the target alone's")
    s.add_argument("--target", required=True)
    s.add_argument("--url", required=True)
    s.add_argument("--prompts", required=True, action="append", help="JSONL (repeatable)")
    s.add_argument("--n", type=int, default=4, help="prompts checked per file")
    s.add_argument("--max-new-tokens", type=int, default=32)
    s.add_argument("--min-gap", type=float, default=1e-3)
    a = ap.parse_args(argv)
    if a.cmd == "world":
        print(f"tiny random Qwen3 and prompts in {make_world(a.out)}")
        return 0
    from flashmap.prompts import read_prompt_lines

    prompts = [ids for f in a.prompts for _, _, ids in read_prompt_lines(f, a.target)[: a.n]]
    return check_served(a.target, a.url, prompts, a.max_new_tokens, a.min_gap)


if __name__ == "__main__":
    sys.exit(main())
