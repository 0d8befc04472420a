"""The checks a verify batch passes before the target engine touches any cache: every row
names an allocated slot once, its tokens, start position, sampling parameters, draft support,
further decoded tokens, kept features and log-probabilities fit the engine. A bad row raises InvalidRequest with
one line that names it."""

from __future__ import annotations

import dataclasses

import numpy as np

from flashmap.types import (
    MAX_PLAIN_TOKENS,
    MAX_TOP_LOGPROBS,
    InvalidRequest,
    SamplingParams,
    VerifyRow,
)


def check_slot(slot: int, allocated: list[bool], where: str = "") -> None:
    n = len(allocated)
    if not isinstance(slot, (int, np.integer)) or not 0 <= slot < n:
        raise InvalidRequest(f"{where}slot {slot!r} out of range [0, {n})")
    if not allocated[slot]:
        raise InvalidRequest(f"{where}slot {slot} is not allocated")


def validate_rows(
    rows: list[VerifyRow],
    allocated: list[bool],
    lengths: list[int],
    vocab_size: int,
    max_seq_len: int,
) -> list[VerifyRow]:
    """Raise InvalidRequest (one line, naming the row) for any bad row of a verify batch
    against the engine's slots (allocated, lengths) and sizes; return the rows with tokens [L],
    support_ids [K, S] and next_seeds as int64 arrays."""
    seen: set[int] = set()
    out = []
    V = vocab_size
    for i, r in enumerate(rows):
        where = f"row {i}: "
        check_slot(r.slot, allocated, where)
        if r.slot in seen:
            raise InvalidRequest(f"{where}slot {r.slot} appears twice in one verify batch")
        seen.add(r.slot)
        t = np.asarray(r.tokens)
        if t.ndim != 1 or t.size == 0:
            raise InvalidRequest(
                f"{where}tokens must be a non-empty 1-D array, got shape {t.shape}"
            )
        if not np.issubdtype(t.dtype, np.integer):
            raise InvalidRequest(f"{where}tokens must be integers, got dtype {t.dtype}")
        bad = t[(t < 0) | (t >= V)]
        if bad.size:
            raise InvalidRequest(f"{where}token id {int(bad[0])} outside the vocabulary [0, {V})")
        n, start, have = len(t), r.start_pos, lengths[r.slot]
        if not 0 <= start <= have:
            raise InvalidRequest(
                f"{where}start_pos {start} outside [0, {have}] (the slot holds {have} tokens)"
            )
        if start + n > max_seq_len:
            raise InvalidRequest(
                f"{where}start_pos + len(tokens) = {start + n} > max_seq_len {max_seq_len}"
            )
        if not isinstance(r.params, SamplingParams):
            raise InvalidRequest(
                f"{where}params must be SamplingParams, got {type(r.params).__name__}"
            )
        try:
            r.params.validate()
        except InvalidRequest as e:
            raise InvalidRequest(f"{where}{e}") from None
        sup = validate_support(r.support_ids, n, vocab_size, where)
        seeds = np.asarray(r.next_seeds)
        if seeds.ndim != 1 or not (np.issubdtype(seeds.dtype, np.integer) or seeds.size == 0):
            raise InvalidRequest(
                f"{where}next_seeds must be a 1-D integer array, got shape {seeds.shape}"
            )
        if seeds.size:
            if sup.shape[0]:
                raise InvalidRequest(
                    f"{where}a row with drafts decodes one step: next_seeds must be empty"
                )
            if seeds.size >= MAX_PLAIN_TOKENS:
                raise InvalidRequest(
                    f"{where}{seeds.size + 1} tokens decoded; at most {MAX_PLAIN_TOKENS}"
                )
            if start + n + seeds.size > max_seq_len:
                raise InvalidRequest(
                    f"{where}start_pos + len(tokens) + len(next_seeds) = {start + n + seeds.size}"
                    f" > max_seq_len {max_seq_len}"
                )
        ff = r.features_from
        if (
            not isinstance(ff, (int, np.integer))
            or not -1 <= ff <= start
            or (ff >= 0 and not r.features)
        ):
            raise InvalidRequest(
                f"{where}features_from {ff!r}: -1, or a position in [0, start_pos {start}] "
                "of a row with features"
            )
        if not (isinstance(r.logprobs, (int, np.integer)) and -1 <= r.logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequest(
                f"{where}logprobs {r.logprobs!r}: -1 (none) or the top tokens, 0..{MAX_TOP_LOGPROBS}"
            )
        out.append(
            dataclasses.replace(
                r,
                tokens=t.astype(np.int64, copy=False),
                support_ids=sup,
                next_seeds=seeds.astype(np.int64, copy=False),
            )
        )
    return out


def validate_support(sup: np.ndarray, n_tokens: int, vocab_size: int, where: str) -> np.ndarray:
    """support_ids [K, S]: ids in [-1, vocab_size) (-1 pads), no repeat within a slot, K + 1 <= n_tokens."""
    sup = np.asarray(sup)
    if sup.ndim != 2 or not (np.issubdtype(sup.dtype, np.integer) or sup.size == 0):
        raise InvalidRequest(
            f"{where}support_ids must be a 2-D integer array [K, S], got shape {sup.shape}"
        )
    K = sup.shape[0]
    if K + 1 > n_tokens:
        raise InvalidRequest(
            f"{where}{K} draft tokens need at least {K + 1} input tokens, got {n_tokens}"
        )
    bad = sup[(sup < -1) | (sup >= vocab_size)]
    if bad.size:
        raise InvalidRequest(f"{where}support id {int(bad[0])} outside [-1, {vocab_size})")
    # Sorted, a repeat is two equal neighbours; padding (-1) may repeat. One vectorised
    # test: a loop of np.unique per slot was a visible share of a verify's host time.
    srt = np.sort(sup, axis=1)
    dup = ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(axis=1)  # [K]
    if dup.any():
        raise InvalidRequest(f"{where}support_ids[{int(dup.argmax())}] repeats a token id")
    return sup.astype(np.int64, copy=False)


def check_tree(row: VerifyRow) -> None:
    """A validated row whose drafts form a tree (TargetEngine.verify_tree): one step, K parents
    each an earlier draft or -1 (the anchor), any temperature (target_service.tree)."""
    if len(row.next_seeds):
        raise InvalidRequest("tree verification decodes one step: next_seeds must be empty")
    K, p = row.num_draft, np.asarray(row.parents, np.int64)
    if K == 0 or p.shape != (K,) or ((p < -1) | (p >= np.arange(K))).any():
        raise InvalidRequest(
            f"parents must give each of the {K} drafts an earlier draft or -1 (the anchor), "
            f"got {p.tolist()}"
        )
    q = np.asarray(row.support_q)
    if q.size:
        if row.params.greedy:
            raise InvalidRequest("support_q (a proposal law) goes with rows at temperature > 0")
        if q.shape != row.support_ids.shape or not np.isfinite(q).all() or (q < 0).any():
            raise InvalidRequest(
                f"support_q must be probabilities shaped like support_ids {row.support_ids.shape}"
            )
