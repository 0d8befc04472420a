"""Verification statistics: target logits -> the numbers of ARCHITECTURE.md's exact-sampling protocol.

For each verify row the target returns, at the last K+1 positions:
- argmax of the raw logits (all the orchestrator needs at temperature 0);
- at T > 0, with p_k the distribution after temperature, top-k and top-p:
  p_k(s) for each support id s in S_k (padding -1 -> 0), the complement mass
  c_k = 1 - sum_s p_k(s), and one sample y_k ~ p_k restricted to the complement of S_k;
  at the bonus position (row K) S is empty, so y_K ~ p_{K+1}.

Sampling is Gumbel-max in its exponential-race form, argmax_v p(v) / E_v with
E_v ~ Exp(1) (as vLLM samples): masking the support and zero-probability tokens is
setting their p to 0. Noise comes from a generator seeded with row.round_seed and
depends only on that seed and the row's shape, so a row's samples do not change
with the batch it was verified in.

When c_k <= COMPLEMENT_EPS there is nothing left to sample: y_k = -1 and c_k is
reported as 0, so the orchestrator never takes a branch without a token (the mass
dropped is below fp32 rounding of the support probabilities).

Log-probabilities (rows with VerifyRow.logprobs >= 0, `logprob_stats`): of the raw
distribution, log-softmax of the logits before temperature, top-k and top-p (vLLM's default,
"raw_logprobs"), at the same K+1 positions: of each support id, of the target's own token
(argmax at T = 0, y_k otherwise) and of the n most likely tokens. Every token a round can
commit is one of these, so the log-probability of what is committed comes from the verify
pass itself, whatever the drafter proposed.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from flashmap.types import VerifyRow

COMPLEMENT_EPS = 1e-6


class RowStats(NamedTuple):
    """VerifyResult without the features (see flashmap.types.VerifyResult)."""

    argmax: np.ndarray  # [K+1] int64
    support_probs: np.ndarray  # [K, S] float32; [0, S] at T=0
    complement: np.ndarray  # [K] float32; [0] at T=0
    residual: np.ndarray  # [K+1] int64; all -1 at T=0


class RowLogprobs(NamedTuple):
    """VerifyResult's log-probabilities (empty [0, 0] for a row that does not ask)."""

    logprobs: np.ndarray  # [K+1, S+1] float32: of the support ids, then of the own token
    top_ids: np.ndarray  # [K+1, n] int64
    top_logprobs: np.ndarray  # [K+1, n] float32


NO_LOGPROBS = RowLogprobs(
    np.zeros((0, 0), np.float32), np.zeros((0, 0), np.int64), np.zeros((0, 0), np.float32)
)


def process_logits(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Probabilities after temperature, then top-k, then top-p (HF / vLLM semantics).

    logits [N, V]; temperature [N] (> 0), top_k [N] int (0 = off), top_p [N] (1 = off);
    returns probabilities [N, V] fp32. Top-k keeps every token tied with the k-th
    largest logit; top-p removes the smallest tokens whose cumulative mass is
    <= 1 - top_p and always keeps the largest.
    """
    temperature, top_k, top_p = (
        torch.as_tensor(x, device=logits.device) for x in (temperature, top_k, top_p)
    )
    scaled = logits.float() / temperature.float()[:, None]  # [N, V]
    k_on, p_on = bool((top_k > 0).any()), bool((top_p < 1).any())
    if not (k_on or p_on):
        return scaled.softmax(-1)
    V = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1)  # ascending, [N, V]
    if k_on:
        k = torch.where(top_k > 0, top_k.clamp(max=V), V).long()  # [N]
        kth = sorted_logits.gather(1, (V - k)[:, None])  # [N, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if p_on:
        cum = sorted_logits.softmax(-1).cumsum(-1)  # [N, V]
        # 1 - top_p rounded once from float64, as HF's Python-float threshold is.
        drop = cum <= (1 - top_p.double()).float()[:, None]
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return sorted_logits.scatter(1, order, sorted_logits).softmax(-1)


def argmax_ids(logits: Tensor) -> np.ndarray:
    """[N] int64 argmax of logits [N, V] (first index on ties, NaN counts as the maximum, as
    torch.argmax). On CPU through numpy, whose argmax over a verify's rows is several times
    faster than torch's, and a verify round pays it every time."""
    if logits.device.type == "cpu":
        return logits.numpy().argmax(-1).astype(np.int64)
    return logits.argmax(-1).cpu().numpy().astype(np.int64)


def verification_stats(
    logits: Tensor,
    rows: list[VerifyRow],
    argmax: np.ndarray | None = None,
    starts: list[int] | None = None,
) -> list[RowStats]:
    """Statistics of each row's last K+1 positions, rows in order.

    logits [N, V]: row i's positions are logits[starts[i] : starts[i] + K_i + 1] (default:
    rows packed back to back from 0). argmax [N] (host), when the caller already has it
    (the CUDA-graph path computes it on the device with the logits). Only rows with T > 0
    touch the logits again, on their device; what comes back to the host is O(K * S)."""
    counts = [r.num_draft + 1 for r in rows]
    starts = _packed_starts(counts) if starts is None else starts
    top = argmax_ids(logits) if argmax is None else argmax
    argmaxes = [np.asarray(top[s : s + c], np.int64) for s, c in zip(starts, counts)]
    sampled = _sample_rows(logits, rows, counts, starts)
    out = []
    for i, r in enumerate(rows):
        if i in sampled:
            out.append(RowStats(argmaxes[i], *sampled[i]))
        else:
            S = r.support_ids.shape[1]
            none = np.full(counts[i], -1, np.int64)
            out.append(
                RowStats(argmaxes[i], np.zeros((0, S), np.float32), np.zeros(0, np.float32), none)
            )
    return out


def _packed_starts(counts: list[int]) -> list[int]:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()


def logprob_stats(
    logits: Tensor, rows: list[VerifyRow], stats: list[RowStats], starts: list[int] | None = None
) -> list[RowLogprobs]:
    """Per row (positions as in verification_stats) its RowLogprobs: the support ids' and the
    own token's (from `stats`) raw log-probabilities and the top VerifyRow.logprobs tokens;
    NO_LOGPROBS for rows that do not ask, which cost nothing."""
    picked = [i for i, r in enumerate(rows) if r.logprobs >= 0]
    out = [NO_LOGPROBS] * len(rows)
    if not picked:
        return out
    counts = [r.num_draft + 1 for r in rows]
    starts = _packed_starts(counts) if starts is None else starts
    V = logits.shape[-1]
    index = np.concatenate([np.arange(starts[i], starts[i] + counts[i]) for i in picked])
    S = max(rows[i].support_ids.shape[1] for i in picked)
    candidates = np.full((len(index), S + 1), V, np.int64)  # V: no token (-inf)
    at = 0
    for i in picked:
        r, n = rows[i], counts[i]
        sup = r.support_ids
        candidates[at : at + sup.shape[0], : sup.shape[1]] = np.where(sup >= 0, sup, V)
        own = stats[i].argmax if r.params.greedy else stats[i].residual
        candidates[at : at + n, S] = np.where(own >= 0, own, V)
        at += n
    lp, top_ids, top_lp = candidate_logprobs(
        logits[torch.as_tensor(index, device=logits.device)],
        candidates,
        max(rows[i].logprobs for i in picked),
    )
    at = 0
    for i in picked:
        r, n, s = rows[i], counts[i], rows[i].support_ids.shape[1]
        cols = np.r_[np.arange(s), S]
        top = slice(0, r.logprobs)
        out[i] = RowLogprobs(
            lp[at : at + n][:, cols], top_ids[at : at + n, top], top_lp[at : at + n, top]
        )
        at += n
    return out


def path_logprobs(
    logits: Tensor, row: VerifyRow, path: np.ndarray, picked: np.ndarray
) -> RowLogprobs:
    """A tree row's RowLogprobs for its accepted path, as a chain of that path would get them:
    logits [1 + K, V] of the row's anchor and drafts; picked [len(path) + 1] the target's
    tokens along the path (the path's drafts, then the token after it)."""
    if row.logprobs < 0:
        return NO_LOGPROBS
    V = logits.shape[-1]
    nodes = torch.as_tensor(np.concatenate([[0], 1 + path]), device=logits.device)
    drafts = row.tokens[len(row.tokens) - row.num_draft :][path]
    candidates = np.stack([np.r_[drafts, V], picked]).T.astype(np.int64)  # [a + 1, 2]
    return RowLogprobs(*candidate_logprobs(logits[nodes], candidates, row.logprobs))


def candidate_logprobs(
    logits: Tensor, candidates: np.ndarray, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """logits [M, V]; candidates [M, C] token ids (V: none). The raw log-probabilities of the
    candidates [M, C] (-inf for none), and the n most likely tokens [M, n] with theirs."""
    lsm = logits.float().log_softmax(-1)  # [M, V]
    padded = torch.cat([lsm, lsm.new_full((lsm.shape[0], 1), float("-inf"))], dim=1)
    picked = padded.gather(1, torch.as_tensor(candidates, device=lsm.device))  # [M, C]
    top_lp, top_ids = lsm.topk(n, dim=-1) if n else (lsm[:, :0], lsm[:, :0].long())
    return (
        picked.cpu().numpy().astype(np.float32),
        top_ids.cpu().numpy().astype(np.int64),
        top_lp.cpu().numpy().astype(np.float32),
    )


def _sample_rows(
    logits: Tensor, rows: list[VerifyRow], counts: list[int], starts: list[int]
) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Support probs, complement and residual/bonus samples of the rows with T > 0, batched."""
    picked = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not picked:
        return {}
    device, V = logits.device, logits.shape[-1]
    index = torch.as_tensor(
        np.concatenate([np.arange(starts[i], starts[i] + counts[i]) for i in picked]), device=device
    )
    n = [counts[i] for i in picked]
    offsets = np.concatenate([[0], np.cumsum(n)])  # of each picked row in the [M, ...] tensors

    def per_position(values: list) -> Tensor:
        return torch.as_tensor(np.repeat(values, n), device=device)

    probs = process_logits(
        logits[index],
        per_position([rows[i].params.temperature for i in picked]),
        per_position([rows[i].params.top_k for i in picked]),
        per_position([rows[i].params.top_p for i in picked]),
    )  # [M, V]

    # Supports padded to one width; the bonus position has none. Padding points at a
    # dummy column V so that gather/scatter never touch a real token.
    S = max(max(rows[i].support_ids.shape[1] for i in picked), 1)
    ids = np.full((len(index), S), V, np.int64)
    for j, i in enumerate(picked):
        sup = rows[i].support_ids
        ids[offsets[j] : offsets[j] + sup.shape[0], : sup.shape[1]] = np.where(sup >= 0, sup, V)
    ids_t = torch.as_tensor(ids, device=device)  # [M, S]
    padded = torch.cat([probs, probs.new_zeros(len(index), 1)], dim=1)  # [M, V+1]
    support_probs = padded.gather(1, ids_t)  # [M, S], 0 on padding
    in_support = torch.zeros_like(padded, dtype=torch.bool).scatter_(1, ids_t, True)[:, :V]
    outside = probs.masked_fill(in_support, 0.0)  # [M, V]
    complement = outside.sum(-1)  # [M]; = 1 - sum(support_probs), without the cancellation

    noise = torch.cat(
        [exponential_noise(rows[i].round_seed, (counts[i], V), device) for i in picked]
    )
    residual = (outside / noise).argmax(-1)  # [M]
    empty = complement <= COMPLEMENT_EPS
    residual = residual.masked_fill(empty, -1)
    complement = complement.masked_fill(empty, 0.0)

    support_probs, complement, residual = (
        t.cpu().numpy() for t in (support_probs, complement, residual)
    )
    out = {}
    for j, i in enumerate(picked):
        lo, K = offsets[j], counts[i] - 1
        out[i] = (
            support_probs[lo : lo + K, : rows[i].support_ids.shape[1]].astype(np.float32),
            complement[lo : lo + K].astype(np.float32),
            residual[lo : lo + K + 1].astype(np.int64),
        )
    return out


def exponential_noise(seed: int, shape: tuple[int, int], device: torch.device) -> Tensor:
    """Exp(1) noise [positions, V] of a row, from its round seed alone."""
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return torch.empty(shape, device=device).exponential_(generator=g)
