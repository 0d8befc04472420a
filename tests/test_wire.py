"""The packed-round codec (flashmap.target_wire): what a round packs is what the target parses, and
a malformed ROWS blob is refused with InvalidRequest, never another exception."""

from __future__ import annotations

import numpy as np
import pytest

from flashmap import target_wire
from flashmap.types import InvalidRequest, SamplingParams, VerifyRow


def _round():
    rng = np.random.default_rng(0)
    greedy = VerifyRow(
        -1,
        40,
        rng.integers(0, 500, 1),
        SamplingParams(),
        support_ids=np.zeros((0, 1), np.int64),
        next_seeds=rng.integers(0, 2**62, 7),
        features=False,
    )
    drafted = VerifyRow(
        -1,
        12,
        rng.integers(0, 500, 17),
        SamplingParams(),
        support_ids=rng.integers(0, 500, (16, 1)),
    )
    sampled = VerifyRow(
        -1,
        7,
        rng.integers(0, 500, 5),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9),
        support_ids=rng.integers(0, 500, (4, 3)),
        round_seed=123456789,
        logprobs=5,
    )
    prompt = VerifyRow(
        -1, 0, rng.integers(0, 500, 30), SamplingParams(), support_ids=np.zeros((0, 1), np.int64)
    )
    drafted.parents = np.r_[-1, np.arange(len(drafted.tokens) - 2)]  # a tree (here a chain)
    greedy.logprobs = 0
    return [
        (11, False, False, greedy),
        (12, False, False, drafted),
        (13, False, True, sampled),
        (14, True, False, prompt),
        (15, False, True, None),
    ]


def test_a_packed_round_parses_back_to_its_rows():
    items = _round()
    blob, bad = target_wire.packed_round(items)
    assert not bad
    parsed = target_wire.parse_packed_round(blob)
    assert [(c, s, e) for c, s, e, _ in parsed] == [(c, s, e) for c, s, e, _ in items]
    for (_, _, _, get), (_, _, _, row) in zip(parsed, items):
        got = target_wire.parse_verify_inputs(get)
        if row is None:
            assert got is None
            continue
        np.testing.assert_array_equal(got.tokens, row.tokens)
        np.testing.assert_array_equal(got.support_ids, row.support_ids)
        assert (got.start_pos, got.round_seed) == (row.start_pos, row.round_seed)
        assert got.next_seeds.tolist() == row.next_seeds.tolist()
        assert got.features == row.features
        assert got.params.temperature == pytest.approx(row.params.temperature)
        assert (got.params.top_k, got.params.top_p) == pytest.approx(
            (row.params.top_k, row.params.top_p)
        )
        assert got.parents.tolist() == row.parents.tolist()
        assert got.logprobs == row.logprobs
    # A greedy decode row carries only what differs from the defaults.
    assert len(blob) < sum(len(target_wire.packed_round([i])[0]) for i in items) + 8


def test_every_truncation_and_corruption_is_refused_cleanly():
    blob, _ = target_wire.packed_round(_round())
    for n in range(len(blob)):
        with pytest.raises(InvalidRequest):
            target_wire.parse_packed_round(blob[:n])
    with pytest.raises(InvalidRequest):
        target_wire.parse_packed_round(blob + b"\0")
    rng = np.random.default_rng(1)
    for _ in range(
        300
    ):  # flipped bytes: a clean refusal or rows that parse; never another exception
        b = bytearray(blob)
        b[int(rng.integers(len(b)))] = int(rng.integers(256))
        try:
            for _, _, _, get in target_wire.parse_packed_round(bytes(b)):
                target_wire.parse_verify_inputs(get)
        except InvalidRequest:
            pass


def test_packed_outputs_parse_back_to_their_results():
    from flashmap.types import VerifyResult

    rng = np.random.default_rng(2)
    feats = lambda n: rng.random((n, 8)).astype(np.float32)  # noqa: E731
    greedy = VerifyResult(
        np.array([5, 6, 7]),
        np.zeros((0, 1), np.float32),
        np.zeros(0, np.float32),
        np.full(3, -1),
        features=feats(3),
    )
    sampled = VerifyResult(
        np.array([1, 2]),
        rng.random((1, 3)).astype(np.float32),
        np.array([0.25], np.float32),
        np.array([9, 4]),
        features=feats(2),
    )
    # Rows that asked for log-probabilities: with the top 3, and with none but their own.
    with_top = VerifyResult(
        *[getattr(sampled, f) for f in ("argmax", "support_probs", "complement", "residual")],
        features=feats(2),
        logprobs=-rng.random((2, 4)).astype(np.float32),
        top_ids=rng.integers(0, 500, (2, 3)),
        top_logprobs=-rng.random((2, 3)).astype(np.float32),
    )
    own_only = VerifyResult(
        np.array([5]),
        np.zeros((0, 1), np.float32),
        np.zeros(0, np.float32),
        np.full(1, -1),
        features=feats(1),
        logprobs=np.array([[-np.inf, -0.5]], np.float32),
        top_ids=np.zeros((1, 0), np.int64),
        top_logprobs=np.zeros((1, 0), np.float32),
    )
    results = [(greedy, []), (sampled, []), (greedy, [0, 3]), (with_top, []), (own_only, [])]
    rows = [target_wire.verify_outputs(r, np.array(p, np.int64)) for r, p in results]
    rows += [target_wire.empty_outputs(8), (target_wire.ROW_INVALID, "bad row")]
    out = target_wire.parse_packed_outputs(target_wire.packed_outputs(rows))
    fields = ("argmax", "support_probs", "complement", "residual", "features")
    for (got, path), (want, want_path) in zip(out, results):
        assert path.tolist() == want_path
        for name in (*fields, "logprobs", "top_ids", "top_logprobs"):
            a, b = getattr(got, name), np.asarray(getattr(want, name))
            assert a.shape == b.shape and np.array_equal(a, b), name
    assert out[5] is None and out[6] == (target_wire.ROW_INVALID, "bad row")
    with pytest.raises(InvalidRequest):
        target_wire.parse_packed_outputs(
            target_wire.pack_arrays([{"PATH": np.zeros((1, 1), np.int64)}])
        )


def test_error_messages_carry_their_row_code():
    for code in (target_wire.ROW_INVALID, target_wire.ROW_UNAVAILABLE, target_wire.ROW_INTERNAL):
        assert target_wire.split_error(
            target_wire.tag_error(code, "START_POS does not continue")
        ) == (
            code,
            "START_POS does not continue",
        )
    assert target_wire.split_error("must specify the START flag") == (
        None,
        "must specify the START flag",
    )


def test_every_block_of_a_drafter_answer_keeps_its_proposal_law_on_the_wire():
    """The drafter's answer (flashmap.wire): the first block and its branches come back with
    their tokens and proposal law, which multi-draft rejection sampling needs of every block."""
    from flashmap.draft_call import DraftAnswer
    from flashmap.drafts import Draft
    from flashmap.wire import answer_from_proto, answer_to_proto

    rng = np.random.default_rng(1)

    def block(k: int, s: int) -> Draft:
        q = rng.dirichlet(np.ones(s), size=k).astype(np.float32)
        return Draft(rng.integers(0, 500, k), rng.integers(0, 500, (k, s)), q, 1)

    sent = [block(5, 4), block(5, 4), Draft.greedy(np.arange(5), 1)]
    got = answer_from_proto(answer_to_proto("s", DraftAnswer(sent))).drafts
    for a, b in zip(sent, got, strict=True):
        assert np.array_equal(a.tokens, b.tokens)
        assert np.array_equal(a.support_ids, b.support_ids)
        assert np.array_equal(a.support_probs, b.support_probs)
