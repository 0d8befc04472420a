"""How the rows of one eager verify become one packed forward pass (`qwen3.forward_step`).

The projections, the MLP and the LM head run over the rows' real tokens back to back
([T, E], T = the rows' total length), so a prompt row, four 17-token verify rows and
eleven 1-token decode rows cost prompt + 4 x 17 + 11 tokens of compute, not 16 rows
padded to the prompt. Attention reads each row's own slot of the cache, so it runs per
group of rows padded to the group's longest row ([b, L] queries over [b, KV, S, D] keys).
The groups are consecutive runs of the rows sorted by length, chosen to minimise the
padded query tokens plus `GROUP_TOKENS` for every group (one more attention call per layer).

What a verify costs is then close to linear in T (the speculation controller's `packed`
price); `python -m bench.verify_cost` measures it against one padded pass.

A verify that runs in a CUDA-graph bucket takes its rows right-padded to one length instead
(`padded_inputs`, [B, L]).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from flashmap.types import VerifyRow
from target_service.qwen3 import AttnGroup

# One more attention call per layer, in padded query tokens of attention (2-core CPU, demo target,
# `python -m bench.verify_cost`: 0 to 16 cost the same within noise; more groups than lengths never help).
GROUP_TOKENS = 8.0


def length_groups(lengths: Sequence[int], group_tokens: float = GROUP_TOKENS) -> list[list[int]]:
    """Row indices in groups of consecutive lengths (shortest first), the partition that
    minimises sum(rows x longest row) over the groups + group_tokens per group. Exact by
    dynamic programming over the G distinct lengths (O(G^2); G <= 18 in a decode round)."""
    lengths = np.asarray(lengths, np.int64)
    if len(lengths) == 0:
        return []
    values, counts = np.unique(lengths, return_counts=True)
    G = len(values)
    rows_before = np.concatenate([[0], np.cumsum(counts)])  # [G + 1]
    best = np.zeros(G + 1)  # best[j]: cost of the first j lengths
    start = np.zeros(G + 1, np.int64)  # start[j]: first length of the last group ending at j
    for j in range(1, G + 1):
        cost = best[:j] + (rows_before[j] - rows_before[:j]) * values[j - 1] + group_tokens
        start[j] = int(np.argmin(cost))
        best[j] = cost[start[j]]
    bounds, j = [], G
    while j > 0:
        bounds.append((start[j], j))
        j = start[j]
    order = np.argsort(lengths, kind="stable")  # the rows of lengths a..b-1 are one slice of it
    return [order[rows_before[a] : rows_before[b]].tolist() for a, b in reversed(bounds)]


@dataclass
class Packed:
    """forward_step's inputs for rows packed back to back."""

    tokens: Tensor  # [T] int64
    positions: Tensor  # [T] int64: RoPE position and cache index of each token
    write_slot: Tensor  # [T] int64
    groups: list[AttnGroup]
    logit_rows: Tensor  # [N] indices into T of each row's last K+1 tokens, rows in order
    lengths: np.ndarray  # [B] tokens per row


def _ranges(firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """firsts[i], firsts[i] + 1, .., firsts[i] + counts[i] - 1 for every i, back to back."""
    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(firsts, counts) + offsets


def pack(rows: list[VerifyRow], device: torch.device, group_tokens: float = GROUP_TOKENS) -> Packed:
    lengths = np.array([len(r.tokens) for r in rows], np.int64)  # [B]
    starts = np.cumsum(lengths) - lengths  # [B] first flat index of each row
    slots = np.array([r.slot for r in rows], np.int64)
    tokens = np.concatenate([r.tokens for r in rows]).astype(np.int64, copy=False)  # [T]
    positions = _ranges(np.array([r.start_pos for r in rows], np.int64), lengths)  # [T]
    n_logits = np.array([r.num_draft + 1 for r in rows], np.int64)
    logit_rows = _ranges(starts + lengths - n_logits, n_logits)  # [N]
    dev = lambda a: torch.as_tensor(a, device=device)  # noqa: E731
    groups = []
    for part in length_groups(lengths, group_tokens):
        n = lengths[part][:, None]  # [b, 1]
        offs = np.arange(n.max())[None]  # [1, L]
        valid = offs < n  # [b, L]
        gather = starts[part][:, None] + np.where(
            valid, offs, 0
        )  # [b, L]; padding repeats the row's first token
        q_limit = np.where(valid, positions[gather], 0)
        flat = gather.reshape(-1)
        if valid.all() and len(part) == len(rows) and (flat == np.arange(len(tokens))).all():
            groups.append(
                AttnGroup(dev(slots[part]), dev(q_limit), int(q_limit.max()) + 1)
            )  # the batch as is
            continue
        keep = None if valid.all() else np.flatnonzero(valid)
        groups.append(
            AttnGroup(
                dev(slots[part]),
                dev(q_limit),
                int(q_limit.max()) + 1,
                gather=dev(flat),
                keep=None if keep is None else dev(keep),
                dest=dev(flat if keep is None else flat[keep]),
            )
        )
    return Packed(
        dev(tokens),
        dev(positions),
        dev(np.repeat(slots, lengths)),
        groups,
        dev(logit_rows),
        lengths,
    )


def padded_inputs(rows: list[VerifyRow], L: int) -> tuple[np.ndarray, ...]:
    """Right-padded model inputs: tokens, positions [B, L], slots [B], valid and
    want-logits masks [B, L] (the last K+1 positions of each row)."""
    B = len(rows)
    tokens, positions = np.zeros((B, L), np.int64), np.zeros((B, L), np.int64)
    valid, want_logits = np.zeros((B, L), bool), np.zeros((B, L), bool)
    for b, r in enumerate(rows):
        n = len(r.tokens)
        tokens[b, :n] = r.tokens
        positions[b, :n] = r.start_pos + np.arange(n)
        valid[b, :n] = True
        want_logits[b, n - r.num_draft - 1 : n] = True
    slots = np.array([r.slot for r in rows], np.int64)
    return tokens, positions, slots, valid, want_logits
