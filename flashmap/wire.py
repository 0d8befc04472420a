"""The wire codec, both directions, for every boundary between the parts.

- Drafter stream (flashmap/v1/drafter.proto): features <-> Tensor, Draft <-> Block.
- Triton target (target_service/model_repository/flashmap_target): VerifyRow <-> the
  model's input tensors, (VerifyResult, winning branch) <-> its output tensors. Arrays
  carry Triton's leading batch dimension of 1; the Triton client and the Python-backend
  model only wrap them in their own tensor types.
- Public API (flashmap/v1/serving.proto): SpecStats <-> the SpecStats message.

Numpy only.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from flashmap.types import Draft, InvalidRequest, SamplingParams, SpecStats, VerifyResult, VerifyRow
from flashmap.v1 import drafter_pb2, serving_pb2

# ----------------------------------------------------------------------------- drafter stream


def features_to_tensor(features: np.ndarray) -> drafter_pb2.Tensor:
    f = np.ascontiguousarray(features, dtype=np.float32)
    return drafter_pb2.Tensor(shape=list(f.shape), dtype="float32", data=f.tobytes())


def tensor_to_features(t: drafter_pb2.Tensor) -> np.ndarray:
    """[m, F] float32; ValueError for a dtype or size that does not fit."""
    if t.dtype not in ("float32", "float16"):
        raise ValueError(f"unsupported feature dtype {t.dtype!r}")
    arr = np.frombuffer(t.data, dtype=np.dtype(t.dtype).newbyteorder("<"))
    return arr.reshape(tuple(t.shape)).astype(np.float32)


def draft_to_block(seq_id: str, blocks: list[Draft]) -> drafter_pb2.Block:
    """A sequence's drafts as one Block: the first in full, the others as branches (tokens)."""
    d = blocks[0]
    return drafter_pb2.Block(
        seq_id=seq_id, tokens=d.tokens.tolist(), support_ids=d.support_ids.reshape(-1).tolist(),
        support_probs=d.support_probs.reshape(-1).tolist(), support_size=d.support_ids.shape[1], steps=d.steps,
        branches=[drafter_pb2.Branch(tokens=b.tokens.tolist()) for b in blocks[1:]],
    )


def block_to_drafts(block: drafter_pb2.Block) -> list[Draft]:
    k, s = len(block.tokens), max(block.support_size, 1)
    main = Draft(np.asarray(block.tokens, np.int64), np.asarray(block.support_ids, np.int64).reshape(k, s),
                 np.asarray(block.support_probs, np.float32).reshape(k, s), int(block.steps))
    return [main] + [Draft.greedy(np.asarray(b.tokens, np.int64), int(block.steps)) for b in block.branches]


# ----------------------------------------------------------------------------- Triton target

VERIFY_OUTPUTS = ("ARGMAX", "SUPPORT_PROBS", "COMPLEMENT", "RESIDUAL", "FEATURES", "BEST")


def verify_inputs(row: VerifyRow, branches: list[np.ndarray] = ()) -> dict[str, np.ndarray]:
    """The model's input tensors for one row (INVALID_ARGUMENT-worthy mistakes raise InvalidRequest)."""
    tokens, support = np.asarray(row.tokens), np.asarray(row.support_ids)
    if tokens.ndim != 1 or tokens.size == 0:
        raise InvalidRequest(f"tokens must be a non-empty 1-D array, got shape {tokens.shape}")
    if support.ndim != 2:
        raise InvalidRequest(f"support_ids must be a 2-D array [K, S], got shape {support.shape}")
    p = row.params
    try:
        out = {
            "TOKENS": tokens.astype(np.int64)[None],
            "START_POS": np.array([[row.start_pos]], np.int64),
            "SUPPORT_IDS": support.astype(np.int64)[None],
            "TEMPERATURE": np.array([[p.temperature]], np.float32),
            "TOP_K": np.array([[p.top_k]], np.int32),
            "TOP_P": np.array([[p.top_p]], np.float32),
            "ROUND_SEED": np.array([[row.round_seed]], np.int64),
        }
        if len(branches):
            out["BRANCHES"] = np.stack([np.asarray(b, np.int64) for b in branches])[None]  # [1, n, K]
    except (OverflowError, ValueError, TypeError) as e:
        raise InvalidRequest(f"verify row does not fit the target's tensor types: {e}") from None
    return out


def release_inputs() -> dict[str, np.ndarray]:
    """A request without tokens: with END it releases the sequence."""
    return {"TOKENS": np.zeros((1, 0), np.int64)}


def _unbatch(get: Callable[[str], np.ndarray | None], name: str, ndim: int, dtype) -> np.ndarray | None:
    a = get(name)
    if a is None:
        return None
    a = np.asarray(a)
    if a.ndim != ndim + 1 or a.shape[0] != 1:
        raise InvalidRequest(f"{name}: expected a batch of one with {ndim + 1} dims, got shape {list(a.shape)}")
    return np.ascontiguousarray(a[0], dtype=dtype)


def scalar(get: Callable[[str], np.ndarray | None], name: str, default):
    a = get(name)
    if a is None:
        return default
    a = np.asarray(a).reshape(-1)
    if a.size != 1:
        raise InvalidRequest(f"{name}: expected one value, got {a.size}")
    return a[0].item()


def parse_verify_inputs(get: Callable[[str], np.ndarray | None]) -> tuple[VerifyRow | None, list[np.ndarray]]:
    """(row, branches) from the model's input tensors (get(name) -> array or None when absent);
    row None for a request without tokens (a release)."""
    tokens = _unbatch(get, "TOKENS", 1, np.int64)
    if tokens is None or tokens.size == 0:
        return None, []
    support = _unbatch(get, "SUPPORT_IDS", 2, np.int64)
    if support is None or support.shape[0] == 0:
        support = np.zeros((0, 1), np.int64)
    params = SamplingParams(
        temperature=float(scalar(get, "TEMPERATURE", 0.0)),
        top_k=int(scalar(get, "TOP_K", 0)),
        top_p=float(scalar(get, "TOP_P", 1.0)),
    ).validate()
    row = VerifyRow(slot=-1, start_pos=int(scalar(get, "START_POS", 0)), tokens=tokens, params=params,
                    support_ids=support, round_seed=int(scalar(get, "ROUND_SEED", 0)))
    branches = _unbatch(get, "BRANCHES", 2, np.int64)
    return row, ([] if branches is None else list(branches))


def verify_outputs(result: VerifyResult, best: int, features_dtype=np.float32) -> dict[str, np.ndarray]:
    """The model's output tensors for one verified row."""
    probs = np.asarray(result.support_probs, np.float32)
    if probs.ndim != 2:  # keep the declared rank [K, S] even for an empty array
        probs = probs.reshape(len(result.complement), -1) if probs.size else np.zeros((0, 0), np.float32)
    out = {
        "ARGMAX": np.asarray(result.argmax, np.int64),
        "SUPPORT_PROBS": probs,
        "COMPLEMENT": np.asarray(result.complement, np.float32).reshape(-1),
        "RESIDUAL": np.asarray(result.residual, np.int64).reshape(-1),
        "FEATURES": np.asarray(result.features).astype(features_dtype, copy=False),
        "BEST": np.array([best], np.int64),
    }
    return {k: np.ascontiguousarray(v[None]) for k, v in out.items()}


def empty_outputs(feature_dim: int, features_dtype=np.float32) -> dict[str, np.ndarray]:
    """Zero-size outputs of the declared ranks (the answer to a release)."""
    return {
        "ARGMAX": np.zeros((1, 0), np.int64), "SUPPORT_PROBS": np.zeros((1, 0, 0), np.float32),
        "COMPLEMENT": np.zeros((1, 0), np.float32), "RESIDUAL": np.zeros((1, 0), np.int64),
        "FEATURES": np.zeros((1, 0, feature_dim), features_dtype), "BEST": np.zeros((1, 1), np.int64),
    }


def parse_verify_outputs(get: Callable[[str], np.ndarray]) -> tuple[VerifyResult, int]:
    """(VerifyResult, index of the winning block) from the model's output tensors."""
    best = get("BEST")
    return VerifyResult(
        argmax=get("ARGMAX")[0].astype(np.int64, copy=False),
        support_probs=get("SUPPORT_PROBS")[0].astype(np.float32, copy=False),
        complement=get("COMPLEMENT")[0].astype(np.float32, copy=False),
        residual=get("RESIDUAL")[0].astype(np.int64, copy=False),
        features=get("FEATURES")[0].astype(np.float32, copy=False),  # FP16 on the wire is allowed
    ), int(best.reshape(-1)[0]) if best is not None and best.size else 0


# ----------------------------------------------------------------------------- public API


def stats_to_proto(s: SpecStats) -> serving_pb2.SpecStats:
    return serving_pb2.SpecStats(
        rounds=s.rounds, drafts=s.drafts, draft_tokens=s.draft_tokens, accepted_tokens=s.accepted,
        mean_acceptance_length=s.mean_acceptance_length, fallback_rounds=s.fallback_rounds,
        draft_steps=s.draft_steps, accepted_per_slot=s.accepted_per_slot.tolist(),
        drafted_per_slot=s.drafted_per_slot.tolist(), verified_per_slot=s.verified_per_slot.tolist(),
    )


def stats_from_proto(p: serving_pb2.SpecStats) -> SpecStats:
    k = max(len(p.accepted_per_slot), len(p.drafted_per_slot), len(p.verified_per_slot))
    return SpecStats(
        block_size=k, rounds=p.rounds, drafts=p.drafts, draft_tokens=p.draft_tokens, accepted=p.accepted_tokens,
        fallback_rounds=p.fallback_rounds, draft_steps=p.draft_steps,
        drafted_per_slot=list(p.drafted_per_slot), verified_per_slot=list(p.verified_per_slot),
        accepted_per_slot=list(p.accepted_per_slot),
    )
