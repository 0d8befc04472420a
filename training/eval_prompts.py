"""The prompts `flashmap eval` (training.evaluate) decodes: the held-out prompts by domain, and
the engine's context made to fit the longest of them (prompts that do not fit are cut to their
last tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

from flashmap.checkpoint import read_config
from flashmap.prompts import read_domain_prompts
from training.eval_methods import Method

DOMAIN_ORDER = ("code", "math", "chat")


def read_prompts(args) -> tuple[dict[str, list[dict]], list[str]]:
    """The prompts of --prompts by domain (--domains, default every domain in DOMAIN_ORDER
    first), the first --max-prompts of each; and the domains."""
    prompts = read_domain_prompts(args.prompts, args.target)
    present = list(dict.fromkeys(p["domain"] for p in prompts))
    domains = (
        [d for d in args.domains.split(",") if d]
        if args.domains
        else [d for d in DOMAIN_ORDER if d in present]
        + [d for d in present if d not in DOMAIN_ORDER]
    )
    missing = [d for d in domains if d not in present]
    if missing:
        raise ValueError(f"{args.prompts}: no prompts of domain(s) {missing} (has {present})")
    by_domain = {d: [p for p in prompts if p["domain"] == d] for d in domains}
    if args.max_prompts:
        by_domain = {d: ps[: args.max_prompts] for d, ps in by_domain.items()}
    return by_domain, domains


def fit_prompts(args, methods: list[Method], by_domain: dict) -> tuple[int, int, int]:
    """The context the engine needs (the longest prompt, the new tokens, the largest draft
    tree), within the target's positions; prompts that do not fit are cut to their last
    tokens, in place. Returns (block size K, max_seq_len, prompts cut)."""
    max_pos = int(read_config(args.target).get("max_position_embeddings", 4096))
    K = max(
        json.loads((Path(m.checkpoint) / "config.json").read_text()).get("block_size", 16)
        for m in methods
    )
    longest = max(len(p["ids"]) for ps in by_domain.values() for p in ps)
    max_seq_len = min(
        max_pos, longest + args.max_new_tokens + K * max(m.tree_width for m in methods) + 2
    )
    keep = max_seq_len - args.max_new_tokens - 1
    if keep < 1:
        raise ValueError(
            f"--max-new-tokens {args.max_new_tokens} does not fit the target's {max_pos} positions"
        )
    truncated = 0
    for ps in by_domain.values():
        for p in ps:
            if len(p["ids"]) > keep:
                p["ids"], truncated = p["ids"][-keep:], truncated + 1
    return K, max_seq_len, truncated
