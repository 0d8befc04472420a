"""Held-out anchors: the drafter data of a held-out prompt file, read back as sequences with
the target's features, and walked anchor by anchor (the offline acceptance, the mode probes)
or cut into training-style blocks (the denoiser curve)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flashmap.drafts import ProposeRequest
from flashmap.prompts import read_prompt_lines
from training.drafter_data import Sequence, list_shards, read_shard
from training.flow import Batch, make_batch


@dataclass
class HeldoutSequence:
    """One held-out prompt answered by the target, with the target's features."""

    index: int  # line order in the prompt file (= order in the data directory)
    domain: str
    domain_index: int  # its position among its domain's prompts
    tokens: np.ndarray  # [L] int64 prompt + response
    features: np.ndarray  # [L, F] float32
    prompt_len: int

    def anchors(self, block_size: int) -> range:
        """Anchor positions with a full reference block after them (the first: the first
        response token, its context the whole prompt, as when serving)."""
        return range(self.prompt_len, len(self.tokens) - block_size)


def heldout_sequences(
    data_dir: str | Path,
    prompts: str | Path,
    target_dir: str | Path | None = None,
    exclude=(),
    domains: tuple[str, ...] | None = None,
    only=None,
) -> list[HeldoutSequence]:
    """The sequences of a drafter data directory made from `prompts` (training.drafter_data on
    a held-out prompt file: dev to choose, test to report; flashmap.prompts), without those
    whose per-domain index is in `exclude`; with `only`, just those per-domain indices."""
    lines = read_prompt_lines(prompts, target_dir)
    seqs = [s for path in list_shards(data_dir) for s in read_shard(path)]
    if len(seqs) != len(lines):
        raise ValueError(
            f"{data_dir} holds {len(seqs)} sequences, {prompts} has {len(lines)} prompts"
        )
    out, seen = [], {}
    for i, ((_, rec, ids), s) in enumerate(zip(lines, seqs)):
        dom = str(rec.get("domain", "all"))
        j = seen[dom] = seen.get(dom, -1) + 1
        if list(s.tokens[: len(ids)].tolist()) != list(ids):
            raise ValueError(
                f"{data_dir}: sequence {i} does not start with prompt {i} of {prompts}"
            )
        if j in exclude or (only is not None and j not in only) or (domains and dom not in domains):
            continue
        out.append(
            HeldoutSequence(
                i,
                dom,
                j,
                s.tokens.numpy().astype(np.int64),
                s.features.float().numpy(),
                int(s.prompt_len),
            )
        )
    return out


def spread_anchors(s: HeldoutSequence, block_size: int, max_anchors: int | None) -> list[int]:
    """The sequence's anchors, at most max_anchors of them spread evenly."""
    a = list(s.anchors(block_size))
    if max_anchors and len(a) > max_anchors:
        a = [a[int(i)] for i in np.linspace(0, len(a) - 1, max_anchors).round()]
    return a


def anchor_rounds(
    proposer,
    group: list[HeldoutSequence],
    anchors: list[list[int]],
    temperature: float,
    top_m: int,
    seed: int,
    prefix: str = "h",
):
    """Walk a group of held-out sequences anchor by anchor: per round r yields (r, live, requests),
    live the indices into group that still have an anchor and one ProposeRequest each, the
    proposer's context extended up to that anchor. Seeds depend on (seed, sequence, anchor)
    only, so two drafters see the same draws. The sequences leave the proposer at the end."""
    names = [f"{prefix}{s.index}" for s in group]
    have = [0] * len(group)  # context positions given to the proposer so far
    try:
        for r in range(max(len(a) for a in anchors)):
            live = [i for i, a in enumerate(anchors) if r < len(a)]
            reqs = []
            for i in live:
                s, a = group[i], anchors[i][r]
                if a > have[i]:
                    proposer.extend(names[i], s.tokens[have[i] : a], s.features[have[i] : a])
                    have[i] = a
                reqs.append(
                    ProposeRequest(
                        names[i],
                        int(s.tokens[a]),
                        temperature=float(temperature),
                        top_m=top_m,
                        seed=int(np.random.SeedSequence([seed, s.index, a]).generate_state(1)[0]),
                    )
                )
            yield r, live, reqs
    finally:
        for n in names:
            proposer.release(n)


def heldout_batches(
    seqs: list[HeldoutSequence],
    block_size: int,
    n_batches: int = 8,
    seqs_per_batch: int = 8,
    anchors_per_seq: int = 8,
    seed: int = 0,
) -> list[Batch]:
    """Training-style Batches of held-out blocks (for `denoiser_curve`)."""
    rng = np.random.default_rng(seed)
    pool = [
        Sequence(torch.from_numpy(s.tokens), torch.from_numpy(s.features), s.prompt_len)
        for s in seqs
        if len(s.anchors(block_size))
    ]
    out = []
    for _ in range(n_batches):
        pick = rng.choice(len(pool), size=min(seqs_per_batch, len(pool)), replace=False)
        out.append(make_batch([pool[i] for i in pick], block_size, anchors_per_seq, 1 << 30, rng))
    return out
