"""The wire codec of the drafter hand-off and of the public API's statistics.

- Drafter stream (flashmap/v1/drafter.proto): an ask (ProposeRequest: the context the drafter
  has not seen, then what to draft) <-> SequenceDraft, an answer (flashmap.draft_call.
  DraftAnswer) <-> Block, features <-> Tensor. The in-process drafter uses the same ask and
  answer without the wire.
- Public API (flashmap/v1/serving.proto): SpecStats <-> the SpecStats message.

The Triton target's tensors are flashmap.target_wire. Numpy only.
"""

from __future__ import annotations

import numpy as np

from flashmap.draft_call import DraftAnswer
from flashmap.drafts import TOP_M, Draft, ProposeRequest
from flashmap.types import SpecStats
from flashmap.v1 import drafter_pb2, serving_pb2

# ----------------------------------------------------------------------------- drafter stream


def features_to_tensor(features: np.ndarray) -> drafter_pb2.Tensor:
    """float16 features travel as float16 (half the bytes; the drafter casts them with torch),
    anything else as float32."""
    dtype = np.float16 if features.dtype == np.float16 else np.float32
    f = np.ascontiguousarray(features, dtype=np.dtype(dtype).newbyteorder("<"))
    return drafter_pb2.Tensor(shape=list(f.shape), dtype=np.dtype(dtype).name, data=f.tobytes())


def tensor_to_features(t: drafter_pb2.Tensor) -> np.ndarray:
    """[m, F] float32 or float16, as sent; ValueError for a dtype or size that does not fit."""
    if t.dtype not in ("float32", "float16"):
        raise ValueError(f"unsupported feature dtype {t.dtype!r}")
    arr = np.frombuffer(t.data, dtype=np.dtype(t.dtype).newbyteorder("<"))
    return arr.reshape(tuple(t.shape)).astype(t.dtype)  # a writable copy in native byte order


def ask_to_proto(a: ProposeRequest) -> drafter_pb2.SequenceDraft:
    """The ask as one sequence of a DraftRequest; its feature pieces joined here."""
    pieces = a.new_features if isinstance(a.new_features, list) else [a.new_features]
    pieces = [np.asarray(p) for p in pieces if p is not None]
    feats = (
        np.zeros((0, 0), np.float32)
        if not pieces
        else pieces[0]
        if len(pieces) == 1
        else np.concatenate(pieces)
    )
    return drafter_pb2.SequenceDraft(
        seq_id=a.seq_id,
        context_start=a.context_start,
        new_token_ids=np.asarray(a.new_tokens, np.int64).tolist(),
        new_features=features_to_tensor(feats),
        anchor=a.anchor,
        draft_steps=a.draft_steps,
        num_blocks=a.blocks,
        temperature=a.temperature,
        top_m=a.top_m,
        seed=a.seed,
        max_draft_tokens=a.max_draft_tokens,
    )


def ask_from_proto(m: drafter_pb2.SequenceDraft) -> ProposeRequest:
    """The ask a SequenceDraft carries (unset draft_steps / max_draft_tokens: None, the
    drafter's step count / the whole block); ValueError for features that do not decode."""
    return ProposeRequest(
        m.seq_id,
        int(m.anchor),
        float(m.temperature),
        int(m.top_m or TOP_M),
        int(m.seed),
        int(m.draft_steps) if m.HasField("draft_steps") else None,
        int(m.max_draft_tokens) if m.HasField("max_draft_tokens") else None,
        max(int(m.num_blocks), 1),
        int(m.context_start),
        np.asarray(m.new_token_ids, np.int64),
        tensor_to_features(m.new_features) if len(m.new_token_ids) else None,
    )


def answer_to_proto(seq_id: str, ans: DraftAnswer) -> drafter_pb2.Block:
    """An answer as a Block: the first draft in full, the others as branches (their tokens and
    proposal law)."""
    if ans.error:
        return drafter_pb2.Block(seq_id=seq_id, error=ans.error)
    d = ans.drafts[0]
    return drafter_pb2.Block(
        seq_id=seq_id,
        tokens=d.tokens.tolist(),
        support_ids=d.support_ids.reshape(-1).tolist(),
        support_probs=d.support_probs.reshape(-1).tolist(),
        support_size=d.support_ids.shape[1],
        draft_steps=d.draft_steps,
        branches=[
            drafter_pb2.Branch(
                tokens=b.tokens.tolist(),
                support_ids=b.support_ids.reshape(-1).tolist(),
                support_probs=b.support_probs.reshape(-1).tolist(),
                support_size=b.support_ids.shape[1],
            )
            for b in ans.drafts[1:]
        ],
        parents=[] if d.parents is None else d.parents.tolist(),
    )


def answer_from_proto(block: drafter_pb2.Block) -> DraftAnswer:
    if block.error:
        return DraftAnswer(error=block.error)
    k, s = len(block.tokens), max(block.support_size, 1)
    main = Draft(
        np.asarray(block.tokens, np.int64),
        np.asarray(block.support_ids, np.int64).reshape(k, s),
        np.asarray(block.support_probs, np.float32).reshape(k, s),
        int(block.draft_steps),
        np.asarray(block.parents, np.int64) if len(block.parents) else None,
    )
    branches = [
        Draft(
            np.asarray(b.tokens, np.int64),
            np.asarray(b.support_ids, np.int64).reshape(len(b.tokens), max(b.support_size, 1)),
            np.asarray(b.support_probs, np.float32).reshape(len(b.tokens), max(b.support_size, 1)),
            int(block.draft_steps),
        )
        if b.support_size
        else Draft.greedy(np.asarray(b.tokens, np.int64), int(block.draft_steps))
        for b in block.branches
    ]
    return DraftAnswer([main, *branches])


# ----------------------------------------------------------------------------- public API


def stats_to_proto(s: SpecStats) -> serving_pb2.SpecStats:
    return serving_pb2.SpecStats(
        rounds=s.rounds,
        drafts=s.drafts,
        draft_tokens=s.draft_tokens,
        accepted_tokens=s.accepted,
        mean_acceptance_length=s.mean_acceptance_length,
        fallback_rounds=s.fallback_rounds,
        draft_steps=s.draft_steps,
        accepted_per_slot=s.accepted_per_slot.tolist(),
        drafted_per_slot=s.drafted_per_slot.tolist(),
        verified_per_slot=s.verified_per_slot.tolist(),
        draft_s=s.draft_s,
        verify_s=s.verify_s,
    )


def stats_from_proto(p: serving_pb2.SpecStats) -> SpecStats:
    k = max(len(p.accepted_per_slot), len(p.drafted_per_slot), len(p.verified_per_slot))
    return SpecStats(
        block_size=k,
        rounds=p.rounds,
        drafts=p.drafts,
        draft_tokens=p.draft_tokens,
        accepted=p.accepted_tokens,
        fallback_rounds=p.fallback_rounds,
        draft_steps=p.draft_steps,
        drafted_per_slot=list(p.drafted_per_slot),
        verified_per_slot=list(p.verified_per_slot),
        accepted_per_slot=list(p.accepted_per_slot),
        draft_s=p.draft_s,
        verify_s=p.verify_s,
    )
