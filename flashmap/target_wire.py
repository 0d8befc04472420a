"""The Triton target's wire codec, both directions: VerifyRow <-> the model's input tensors,
(VerifyResult, a tree's accepted path) <-> its output tensors, and packed rounds (every row of
a round in one request). Arrays carry Triton's leading batch dimension of 1; the Triton client
(orchestrator.target_client) and the Python-backend model (target_service/model_repository)
only wrap them in their own tensor types.

Numpy only.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import numpy as np

from flashmap.types import InvalidRequest, SamplingParams, VerifyResult, VerifyRow

VERIFY_OUTPUTS = (
    "ARGMAX",
    "SUPPORT_PROBS",
    "COMPLEMENT",
    "RESIDUAL",
    "FEATURES",
    "PATH",
    "TOKEN_LOGPROBS",
    "TOP_IDS",
    "TOP_LOGPROBS",
)
# VerifyResult's log-probabilities, by output: empty [0, 0] for a row that does not ask.
LOGPROB_OUTPUTS = {
    "TOKEN_LOGPROBS": ("logprobs", np.float32),
    "TOP_IDS": ("top_ids", np.int64),
    "TOP_LOGPROBS": ("top_logprobs", np.float32),
}


def verify_inputs(row: VerifyRow) -> dict[str, np.ndarray]:
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
        if len(row.next_seeds):
            out["NEXT_SEEDS"] = np.asarray(row.next_seeds, np.int64).reshape(1, -1)
        if not row.features:
            out["NO_FEATURES"] = np.ones((1, 1), np.bool_)
        if row.features_from >= 0:
            out["FEATURES_FROM"] = np.array([[row.features_from]], np.int64)
        if row.is_tree:
            out["PARENTS"] = np.asarray(row.parents, np.int64).reshape(1, -1)
            if row.support_q.size:
                out["SUPPORT_Q"] = np.asarray(row.support_q, np.float32)[None]
        if row.logprobs >= 0:
            out["LOGPROBS"] = np.array([[row.logprobs]], np.int32)
    except (OverflowError, ValueError, TypeError) as e:
        raise InvalidRequest(f"verify row does not fit the target's tensor types: {e}") from None
    return out


def release_inputs() -> dict[str, np.ndarray]:
    """A request without tokens: with END it releases the sequence."""
    return {"TOKENS": np.zeros((1, 0), np.int64)}


def info_inputs() -> dict[str, np.ndarray]:
    """A request for the model's INFO_JSON (send it as a sequence of its own, START and END)."""
    return {**release_inputs(), "INFO": np.ones((1, 1), np.bool_)}


def _unbatch(
    get: Callable[[str], np.ndarray | None], name: str, ndim: int, dtype
) -> np.ndarray | None:
    a = get(name)
    if a is None:
        return None
    a = np.asarray(a)
    if a.ndim != ndim + 1 or a.shape[0] != 1:
        raise InvalidRequest(
            f"{name}: expected a batch of one with {ndim + 1} dims, got shape {list(a.shape)}"
        )
    return np.ascontiguousarray(a[0], dtype=dtype)


def scalar(get: Callable[[str], np.ndarray | None], name: str, default):
    a = get(name)
    if a is None:
        return default
    a = np.asarray(a).reshape(-1)
    if a.size != 1:
        raise InvalidRequest(f"{name}: expected one value, got {a.size}")
    return a[0].item()


def parse_verify_inputs(get: Callable[[str], np.ndarray | None]) -> VerifyRow | None:
    """The row of the model's input tensors (get(name) -> array or None when absent); None for
    a request without tokens (a release)."""
    tokens = _unbatch(get, "TOKENS", 1, np.int64)
    if tokens is None or tokens.size == 0:
        return None
    support = _unbatch(get, "SUPPORT_IDS", 2, np.int64)
    if support is None or support.shape[0] == 0:
        support = np.zeros((0, 1), np.int64)
    params = SamplingParams(
        temperature=float(scalar(get, "TEMPERATURE", 0.0)),
        top_k=int(scalar(get, "TOP_K", 0)),
        top_p=float(scalar(get, "TOP_P", 1.0)),
    ).validate()
    row = VerifyRow(
        slot=-1,
        start_pos=int(scalar(get, "START_POS", 0)),
        tokens=tokens,
        params=params,
        support_ids=support,
        round_seed=int(scalar(get, "ROUND_SEED", 0)),
        features=not bool(scalar(get, "NO_FEATURES", False)),
        features_from=int(scalar(get, "FEATURES_FROM", -1)),
        logprobs=int(scalar(get, "LOGPROBS", -1)),
    )
    seeds = _unbatch(get, "NEXT_SEEDS", 1, np.int64)
    if seeds is not None:
        row.next_seeds = seeds
    parents = _unbatch(get, "PARENTS", 1, np.int64)
    if parents is not None:
        row.parents = parents
    q = _unbatch(get, "SUPPORT_Q", 2, np.float32)
    if q is not None:
        row.support_q = q
    return row


def verify_outputs(
    result: VerifyResult, path: np.ndarray | None = None, features_dtype=np.float32
) -> dict[str, np.ndarray]:
    """The model's output tensors for one verified row (path: a tree's accepted drafts)."""
    probs = np.asarray(result.support_probs, np.float32)
    if probs.ndim != 2:  # keep the declared rank [K, S] even for an empty array
        probs = (
            probs.reshape(len(result.complement), -1)
            if probs.size
            else np.zeros((0, 0), np.float32)
        )
    out = {
        "ARGMAX": np.asarray(result.argmax, np.int64),
        "SUPPORT_PROBS": probs,
        "COMPLEMENT": np.asarray(result.complement, np.float32).reshape(-1),
        "RESIDUAL": np.asarray(result.residual, np.int64).reshape(-1),
        "FEATURES": np.asarray(result.features).astype(features_dtype, copy=False),
        "PATH": np.zeros(0, np.int64) if path is None else np.asarray(path, np.int64),
    }
    for name, (field, dtype) in LOGPROB_OUTPUTS.items():
        out[name] = np.asarray(getattr(result, field), dtype)  # [K+1, S+1] / [K+1, n]
    return {k: np.ascontiguousarray(v[None]) for k, v in out.items()}


def empty_outputs(feature_dim: int, features_dtype=np.float32) -> dict[str, np.ndarray]:
    """Zero-size outputs of the declared ranks (the answer to a release)."""
    return {
        "ARGMAX": np.zeros((1, 0), np.int64),
        "SUPPORT_PROBS": np.zeros((1, 0, 0), np.float32),
        "COMPLEMENT": np.zeros((1, 0), np.float32),
        "RESIDUAL": np.zeros((1, 0), np.int64),
        "FEATURES": np.zeros((1, 0, feature_dim), features_dtype),
        "PATH": np.zeros((1, 0), np.int64),
        **{name: np.zeros((1, 0, 0), dtype) for name, (_, dtype) in LOGPROB_OUTPUTS.items()},
    }


def parse_verify_outputs(
    get: Callable[[str], np.ndarray | None],
) -> tuple[VerifyResult, np.ndarray]:
    """(VerifyResult, a tree row's accepted path: empty for a chain) from the model's output
    tensors (the log-probabilities, absent: none)."""
    path = get("PATH")
    logprobs = {}
    for name, (field, dtype) in LOGPROB_OUTPUTS.items():
        a = get(name)
        if a is not None:
            logprobs[field] = a[0].astype(dtype, copy=False)
    return VerifyResult(
        argmax=get("ARGMAX")[0].astype(np.int64, copy=False),
        support_probs=get("SUPPORT_PROBS")[0].astype(np.float32, copy=False),
        complement=get("COMPLEMENT")[0].astype(np.float32, copy=False),
        residual=get("RESIDUAL")[0].astype(np.int64, copy=False),
        features=get("FEATURES")[
            0
        ],  # float32 or float16, as the model is configured: passed on as it is
        **logprobs,
    ), np.zeros(0, np.int64) if path is None else path.reshape(-1).astype(np.int64)


# ----------------------------------------------------------------------------- packed rounds
# One Triton request can carry a whole round: every row's tensors (the per-row dicts above)
# packed into one bytes tensor ROWS, with the row's sequence id and START / END flags; the
# answer is one bytes tensor ROWS_OUT, per row the output tensors or an error. One request per
# round means one execute() and one forward, however the rows arrive.
#
# Format (little-endian): b"FMR1", u32 rows; per row u16 entries; per entry u8 name length,
# name (ASCII), u8 dtype code, u8 ndim, ndim x u32 dims, then the raw data.

_MAGIC = b"FMR1"
_DTYPES = [
    np.dtype(t).newbyteorder("<")
    for t in ("int64", "int32", "float32", "float16", "uint64", "bool", "uint8")
]
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_MAX_NDIM = 4
_U32, _U16 = struct.Struct("<I"), struct.Struct("<H")
ROW_FLAG_START, ROW_FLAG_END = 1, 2
# Per-row errors in ROWS_OUT (Triton's codes for the same failure of a one-row request).
ROW_INVALID, ROW_UNAVAILABLE, ROW_INTERNAL = 1, 2, 3
_ERROR_NAMES = {
    ROW_INVALID: "INVALID_ARGUMENT",
    ROW_UNAVAILABLE: "UNAVAILABLE",
    ROW_INTERNAL: "INTERNAL",
}


def tag_error(code: int, message: str) -> str:
    """A request's error message that names its row code: Triton's gRPC stream (the model is
    decoupled) answers an error with its message alone."""
    return f"[{_ERROR_NAMES.get(code, 'INTERNAL')}] {message}"


def split_error(message: str) -> tuple[int | None, str]:
    """(row code, message) of a `tag_error` message; (None, message) for any other (Triton's own)."""
    for code, name in _ERROR_NAMES.items():
        if message.startswith(f"[{name}] "):
            return code, message[len(name) + 3 :]
    return None, message


def pack_arrays(rows: list[dict[str, np.ndarray]]) -> bytes:
    parts = [_MAGIC, _U32.pack(len(rows))]
    for row in rows:
        parts.append(_U16.pack(len(row)))
        for name, a in row.items():
            a = np.ascontiguousarray(a)
            code = _CODE.get(a.dtype)  # native order equals "<" on little-endian hosts
            if code is None:
                code = _CODE.get(a.dtype.newbyteorder("<"))
            if code is None or a.ndim > _MAX_NDIM:
                raise InvalidRequest(f"{name}: cannot pack {a.dtype} with {a.ndim} dims")
            key = name.encode("ascii")
            parts += [
                struct.pack(f"<B{len(key)}sBB{a.ndim}I", len(key), key, code, a.ndim, *a.shape),
                a.astype(_DTYPES[code], copy=False).tobytes(),
            ]
    return b"".join(parts)


def unpack_arrays(blob: bytes, names: frozenset[str] | set[str]) -> list[dict[str, np.ndarray]]:
    """Inverse of pack_arrays; InvalidRequest for anything malformed or a name not in `names`.
    Headers are read with struct: a numpy call per header field would cost more per row than
    the row's data."""
    buf = memoryview(blob).cast("B")
    end = len(buf)

    def need(pos: int, n: int) -> None:
        if pos + n > end:
            raise InvalidRequest("ROWS: truncated")

    need(0, 8)
    if bytes(buf[:4]) != _MAGIC:
        raise InvalidRequest("ROWS: not a packed round")
    (count,), pos = _U32.unpack_from(buf, 4), 8
    rows = []
    for _ in range(count):
        need(pos, 2)
        (entries,), pos = _U16.unpack_from(buf, pos), pos + 2
        row = {}
        for _ in range(entries):
            need(pos, 1)
            klen = buf[pos]
            need(pos, 3 + klen)
            name = bytes(buf[pos + 1 : pos + 1 + klen]).decode("ascii", "replace")
            code, ndim = buf[pos + 1 + klen], buf[pos + 2 + klen]
            pos += 3 + klen
            if name not in names or code >= len(_DTYPES) or ndim > _MAX_NDIM:
                raise InvalidRequest(f"ROWS: unexpected entry {name!r}")
            need(pos, 4 * ndim)
            shape = struct.unpack_from(f"<{ndim}I", buf, pos)
            pos += 4 * ndim
            dt, size = _DTYPES[code], math.prod(shape)
            need(pos, size * dt.itemsize)
            row[name] = np.frombuffer(buf, dt, count=size, offset=pos).reshape(shape).copy()
            pos += size * dt.itemsize
        rows.append(row)
    if pos != end:
        raise InvalidRequest("ROWS: trailing bytes")
    return rows


ROW_INPUTS = frozenset(
    {
        "CORRID",
        "FLAGS",
        "TOKENS",
        "START_POS",
        "SUPPORT_IDS",
        "TEMPERATURE",
        "TOP_K",
        "TOP_P",
        "ROUND_SEED",
        "NEXT_SEEDS",
        "NO_FEATURES",
        "FEATURES_FROM",
        "PARENTS",
        "SUPPORT_Q",
        "LOGPROBS",
    }
)
ROW_OUTPUTS = frozenset(VERIFY_OUTPUTS) | {"ERROR", "CODE"}


def packed_round(
    items: list[tuple[int, bool, bool, VerifyRow | None]],
) -> tuple[bytes, dict[int, InvalidRequest]]:
    """ROWS for (sequence id, start, end, row or None for a release) per row, and the rows left
    out because they do not fit the tensor types (index -> their error)."""
    rows, bad = [], {}
    for k, (corrid, start, end, row) in enumerate(items):
        try:
            d = {
                "CORRID": np.array([corrid], np.uint64),
                "FLAGS": np.array(
                    [ROW_FLAG_START * bool(start) | ROW_FLAG_END * bool(end)], np.int32
                ),
            }
            d.update(release_inputs() if row is None else _without_defaults(verify_inputs(row)))
        except InvalidRequest as e:
            bad[k] = e
            continue
        rows.append(d)
    return pack_arrays(rows), bad


# Entries a row may leave out of ROWS: parse_verify_inputs reads an absent one as this value.
_ROW_DEFAULTS = {"TEMPERATURE": 0.0, "TOP_K": 0, "TOP_P": 1.0, "ROUND_SEED": 0}


def _without_defaults(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A greedy decode row carries CORRID, FLAGS, TOKENS and START_POS only: every entry is
    packed and parsed in Python, and the parsing side gives an absent one its default."""
    for name, value in _ROW_DEFAULTS.items():
        if d[name].item() == value:
            del d[name]
    if d["SUPPORT_IDS"].shape == (1, 0, 1):
        del d["SUPPORT_IDS"]
    return d


def parse_packed_round(
    blob: bytes,
) -> list[tuple[int, bool, bool, Callable[[str], np.ndarray | None]]]:
    """(sequence id, start, end, get) per row of ROWS; get(name) reads the row's tensors as
    parse_verify_inputs expects them."""
    out = []
    for d in unpack_arrays(blob, ROW_INPUTS):
        corrid, flags = d.pop("CORRID", None), d.pop("FLAGS", None)
        if corrid is None or corrid.size != 1 or flags is None or flags.size != 1:
            raise InvalidRequest("ROWS: every row needs one CORRID and one FLAGS value")
        f = int(flags.reshape(-1)[0])
        out.append(
            (int(corrid.reshape(-1)[0]), bool(f & ROW_FLAG_START), bool(f & ROW_FLAG_END), d.get)
        )
    return out


def packed_outputs(rows: list[dict[str, np.ndarray] | tuple[int, str]]) -> bytes:
    """ROWS_OUT: per row its output tensors (verify_outputs / empty_outputs) or (error code,
    message). A greedy row's empty sampling outputs, a chain's empty PATH and the empty
    log-probabilities of a row that did not ask are left out (parse_packed_outputs restores
    them)."""
    out = []
    for r in rows:
        if not isinstance(r, dict):
            out.append(
                {
                    "CODE": np.array([r[0]], np.int32),
                    "ERROR": np.frombuffer(r[1].encode(), np.uint8),
                }
            )
            continue
        r = dict(r)
        if (
            r["SUPPORT_PROBS"].shape == (1, 0, 1)
            and r["COMPLEMENT"].size == 0
            and (r["RESIDUAL"] == -1).all()
        ):
            del r["SUPPORT_PROBS"], r["COMPLEMENT"], r["RESIDUAL"]
        if r["PATH"].size == 0:
            del r["PATH"]
        if r.get("TOKEN_LOGPROBS") is not None and r["TOKEN_LOGPROBS"].size == 0:
            for name in LOGPROB_OUTPUTS:
                r.pop(name, None)
        out.append(r)
    return pack_arrays(out)


def parse_packed_outputs(
    blob: bytes,
) -> list[tuple[VerifyResult, np.ndarray] | tuple[int, str] | None]:
    """Per row of ROWS_OUT: (VerifyResult, a tree's accepted path), (error code, message), or
    None for an answered release."""
    out = []
    for d in unpack_arrays(blob, ROW_OUTPUTS):
        if "CODE" in d:
            out.append(
                (int(d["CODE"].reshape(-1)[0]), d["ERROR"].tobytes().decode("utf-8", "replace"))
            )
            continue
        argmax = d.get("ARGMAX")
        if argmax is None or "FEATURES" not in d:
            raise InvalidRequest("ROWS_OUT: a row without ARGMAX or FEATURES")
        if argmax.size == 0:
            out.append(None)
            continue
        d.setdefault("SUPPORT_PROBS", np.zeros((1, 0, 1), np.float32))
        d.setdefault("COMPLEMENT", np.zeros((1, 0), np.float32))
        d.setdefault("RESIDUAL", np.full((1, argmax.shape[-1]), -1, np.int64))
        out.append(parse_verify_outputs(d.get))
    return out
