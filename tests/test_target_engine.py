"""Target engine acceptance: the Qwen3 forward against transformers, the slot KV cache
(batching, rollback, incremental decoding), verification statistics, input validation.

All fp32 on tiny random checkpoints (target_service.random_checkpoint). Greedy
comparisons first check the reference top-2 logit gap, so that an argmax equality
cannot hinge on float rounding (docs/ARCHITECTURE.md, "Floating point").
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch

from flashmap.checkpoint import CheckpointError
from flashmap.drafts import Draft
from flashmap.types import (
    MAX_PLAIN_TOKENS,
    InvalidRequest,
    SamplingParams,
    VerifyRow,
    feature_layers_for,
)
from target_service.engine import NoFreeSlot, TargetEngine
from target_service.packing import GROUP_TOKENS, length_groups, padded_inputs
from target_service.qwen3 import Qwen3
from target_service.qwen3_config import Qwen3Config
from target_service.random_checkpoint import make_random_qwen3
from target_service.verification import argmax_ids, process_logits, verification_stats

transformers = pytest.importorskip("transformers")

CONFIGS = {
    # default: 4 layers, GQA 4:2, untied
    "gqa": dict(),
    # MHA, tied embeddings, 2 layers
    "mha_tied": dict(num_hidden_layers=2, num_key_value_heads=4, tie_word_embeddings=True, seed=1),
    # GQA 4:1, head_dim 32 != 64 / 4, another RoPE base, 3 layers
    "wide_head": dict(
        num_hidden_layers=3, num_key_value_heads=1, head_dim=32, rope_theta=1e6, seed=2
    ),
}
V = 512  # vocab of every config above
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        name: make_random_qwen3(root / name, with_tokenizer=(name == "gqa"), **kw)
        for name, kw in CONFIGS.items()
    }


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    return {
        name: transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for name, path in checkpoints.items()
    }


@pytest.fixture(scope="module")
def model(checkpoints):
    return Qwen3.from_pretrained(checkpoints["gqa"])


def fresh_engine(model, n_slots=1) -> TargetEngine:
    """An engine with fresh caches around `model`, every layer as a feature layer. It
    replaces the model's caches: earlier engines around the same model are stale."""
    return TargetEngine.from_model(
        model, n_slots=n_slots, max_seq_len=128, feature_layers=list(range(4))
    )


@pytest.fixture
def engine(model):
    return fresh_engine(model, n_slots=4)


def hf_forward(hf, tokens: np.ndarray):
    """Logits [L, V] and hidden states (tuple of [L, E]) of one full sequence."""
    with torch.no_grad():
        out = hf(torch.as_tensor(tokens)[None], use_cache=False, output_hidden_states=True)
    return out.logits[0], [h[0] for h in out.hidden_states]


def assert_clear_argmax(logits: torch.Tensor, min_gap: float = 1e-3) -> None:
    top2 = logits.topk(2, dim=-1).values
    gap = float((top2[..., 0] - top2[..., 1]).min())
    assert gap > min_gap, f"reference top-2 gap {gap} too small for an argmax comparison"


def rel_err(a, b) -> float:
    """Max abs difference relative to the reference's largest entry (hidden states grow
    along the residual stream, so elementwise rtol is meaningless for small entries)."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return float((a - b).abs().max() / b.abs().max())


def seq(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, n)


def row(slot, start, tokens, k=0, params=GREEDY, seed=0) -> VerifyRow:
    """A verify row whose K draft tokens are its last K tokens, greedy supports."""
    tokens = np.asarray(tokens, np.int64)
    support = tokens[len(tokens) - k :, None] if k else np.zeros((0, 1), np.int64)
    return VerifyRow(slot, start, tokens, params, support, seed)


def tree_row(slot, start, anchor, blocks, params=GREEDY) -> VerifyRow:
    """A row drafting `blocks` after `anchor` as one tree (Draft.merged)."""
    t = Draft.merged(blocks)
    r = row(slot, start, np.r_[anchor, t.tokens], k=len(t.tokens), params=params)
    r.parents = t.parents
    return r


def all_layer_features(engine, res) -> np.ndarray:
    return res.features.reshape(len(res.features), len(engine.feature_layers), engine.hidden_size)


# -- forward vs transformers ---------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_features_match_transformers(name, checkpoints, hf_models):
    hf = hf_models[name]
    m = Qwen3.from_pretrained(checkpoints[name])
    n_layers = m.config.num_hidden_layers
    eng = TargetEngine.from_model(
        m, n_slots=3, max_seq_len=64, feature_layers=list(range(n_layers))
    )
    # Two rows of different lengths in one padded pass; logits for every position.
    seqs = [seq(37, 1), seq(20, 2)]
    B, L = 2, 37
    tokens = torch.zeros(B, L, dtype=torch.long)
    valid = torch.zeros(B, L, dtype=torch.bool)
    for b, s in enumerate(seqs):
        tokens[b, : len(s)] = torch.as_tensor(s)
        valid[b, : len(s)] = True
    with torch.inference_mode():
        logits, _ = m(tokens, torch.arange(L).expand(B, L), torch.tensor([2, 0]), valid, valid)
    ref = [hf_forward(hf, s) for s in seqs]
    assert rel_err(logits, torch.cat([r[0] for r in ref])) < 1e-4

    # Engine path: features of every layer = HF hidden_states[l + 1]; argmax of the last position.
    slot = eng.allocate()
    res = eng.verify([row(slot, 0, seqs[0])])[0]
    feats = all_layer_features(eng, res)
    for l in range(n_layers):
        assert rel_err(feats[:, l], ref[0][1][l + 1]) < 1e-4, f"layer {l}"
    assert_clear_argmax(ref[0][0][-1:])
    assert res.argmax.tolist() == [int(ref[0][0][-1].argmax())]


def test_engine_defaults(checkpoints):
    eng = TargetEngine(checkpoints["gqa"])
    c = eng.config
    assert eng.feature_layers == feature_layers_for(4)
    assert (
        eng.feature_dim == len(eng.feature_layers) * 64 == eng.hidden_size * len(eng.feature_layers)
    )
    assert (eng.vocab_size, eng.num_layers, eng.n_slots, eng.free_slots) == (V, 4, 8, 8)
    assert eng.max_seq_len == min(c.max_position_embeddings, 4096) == 512
    assert eng.kv_bytes_per_token == 2 * 4 * 2 * 16 * 4
    tok = transformers.AutoTokenizer.from_pretrained(checkpoints["gqa"])
    assert tok.eos_token_id in eng.eos_token_ids and len(tok) <= V


def test_bf16_runs(checkpoints):
    eng = TargetEngine(checkpoints["gqa"], n_slots=1, max_seq_len=32, dtype=torch.bfloat16)
    res = eng.verify([row(eng.allocate(), 0, seq(9), k=3)])[0]
    assert res.features.dtype == np.float32 and res.features.shape == (9, eng.feature_dim)
    assert np.isfinite(res.features).all() and res.argmax.shape == (4,)


# -- slot cache: batching, rollback, incremental decoding ----------------------------


def test_batched_verify_equals_each_row_alone(engine, model, hf_models):
    sampled = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)
    history = {0: seq(20, 3), 1: seq(7, 4), 2: np.zeros(0, np.int64)}
    new = {0: seq(6, 5), 1: seq(9, 6), 2: seq(31, 7)}
    specs = {0: (5, GREEDY), 1: (4, sampled), 2: (0, sampled)}  # slot: (K, params)

    rows = {
        s: row(s, len(history[s]), new[s], specs[s][0], specs[s][1], seed=10 + s) for s in history
    }

    # Batched: the two histories prefilled together (different lengths), then all three rows.
    for s in history:
        assert engine.allocate() == s
    engine.verify([row(0, 0, history[0]), row(1, 0, history[1])])
    batched = dict(zip(history, engine.verify(list(rows.values()))))

    for s in history:
        solo = fresh_engine(model)
        slot = solo.allocate()
        if len(history[s]):
            solo.verify([row(slot, 0, history[s])])
        alone = solo.verify([dataclasses.replace(rows[s], slot=slot)])[0]
        b = batched[s]
        np.testing.assert_array_equal(b.argmax, alone.argmax)
        assert rel_err(b.features, alone.features) < 1e-5
        np.testing.assert_allclose(b.support_probs, alone.support_probs, rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(b.residual, alone.residual)  # same round_seed, same samples
        assert engine.length(s) == len(history[s]) + len(new[s])

    # And against transformers on the full sequences.
    for s in (0, 1, 2):
        full = np.concatenate([history[s], new[s]])
        logits, hidden = hf_forward(hf_models["gqa"], full)
        K = specs[s][0]
        assert_clear_argmax(logits[-K - 1 :])
        assert batched[s].argmax.tolist() == logits[-K - 1 :].argmax(-1).tolist()
        ref = hidden[2][len(history[s]) :]  # layer 1 = hidden_states[2]
        assert rel_err(all_layer_features(engine, batched[s])[:, 1], ref) < 1e-4


@pytest.mark.parametrize("group_tokens", [0.0, GROUP_TOKENS, 1e9])
def test_packed_verify_equals_one_padded_pass(model, group_tokens):
    """A prompt, verify rows of several lengths and decode rows, packed back to back with
    attention per length group (every length its own group / the default rule / one group),
    give what one padded pass over [B, longest] gives: the same argmax, features and logits."""
    lengths = [1, 9, 17, 1, 30]
    runs = {}
    for mode in ("padded", "packed"):
        eng = fresh_engine(model, n_slots=5)
        eng.group_tokens = group_tokens
        hist = [row(eng.allocate(), 0, seq(12 + s, 20 + s)) for s in range(4)]
        eng.verify(hist)
        rows = [
            row(h.slot, len(h.tokens), seq(n, 30 + i), k=min(n - 1, 16))
            for i, (h, n) in enumerate(zip(hist, lengths))
        ]
        rows.append(row(eng.allocate(), 0, seq(lengths[-1], 40), k=0))  # a prefill beside them
        if mode == "packed":
            runs[mode] = eng.verify(rows)
            continue
        with torch.inference_mode():
            batch = [
                torch.as_tensor(a) for a in padded_inputs(rows, max(len(r.tokens) for r in rows))
            ]
            logits, features = eng.model(
                *batch, eng._feature_layers, max(r.start_pos + len(r.tokens) for r in rows)
            )
        runs[mode] = (
            logits,
            np.split(features.numpy(), np.cumsum([len(r.tokens) for r in rows])[:-1]),
        )
    groups = length_groups([len(r.tokens) for r in rows], group_tokens)
    assert len(groups) == {0.0: 4, 1e9: 1}.get(group_tokens, len(groups))
    logits, feats = runs["padded"]
    start = 0
    for r, got, f in zip(rows, runs["packed"], feats):
        n = r.num_draft + 1
        np.testing.assert_array_equal(got.argmax, logits[start : start + n].argmax(-1).numpy())
        assert rel_err(got.features, f) < 1e-5
        start += n


def test_length_groups_minimise_padding_plus_group_cost():
    """The dynamic programme against every partition of the sorted lengths into runs."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        lengths = rng.choice([1, 1, 1, 2, 5, 9, 17, 40], size=int(rng.integers(1, 9))).tolist()
        gt = float(rng.choice([0.0, 3.0, 8.0, 60.0]))
        values = sorted(set(lengths))
        count = {v: lengths.count(v) for v in values}

        def cost(cuts):  # cuts: ends of runs over values
            total, a = 0.0, 0
            for b in cuts:
                total += sum(count[v] for v in values[a:b]) * values[b - 1] + gt
                a = b
            return total

        G = len(values)
        best = min(
            cost([*inner, G]) for k in range(G) for inner in itertools.combinations(range(1, G), k)
        )
        groups = length_groups(lengths, gt)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert sum(len(g) * max(lengths[i] for i in g) + gt for g in groups) == pytest.approx(best)
        assert all(
            max(lengths[i] for i in g) < min(lengths[i] for i in h)
            for g, h in zip(groups, groups[1:])
        )
    assert length_groups([1] * 15 + [17], 8) == [list(range(15)), [15]]
    assert length_groups([5] * 8, 0) == [list(range(8))]  # equal rows: one group


def test_rollback_then_reverify_equals_fresh_run(engine, model):
    tokens = seq(40, 8)
    slot = engine.allocate()
    engine.verify([row(slot, 0, tokens[:30])])
    engine.verify([row(slot, 30, seq(15, 9), k=14)])  # a rejected block: 30..44 now stale
    assert engine.length(slot) == 45
    # Roll back to 25, batched with a longer row so the stale 35..44 lie inside the attended span.
    other = engine.allocate()
    res = engine.verify([row(slot, 25, tokens[25:35], k=9), row(other, 0, seq(60, 11))])[0]
    assert engine.length(slot) == 35

    fresh = fresh_engine(model)
    ref = fresh.verify([row(fresh.allocate(), 0, tokens[:35], k=9)])[0]
    np.testing.assert_array_equal(res.argmax, ref.argmax)
    assert rel_err(res.features, ref.features[25:]) < 1e-5


def test_next_seeds_decode_as_separate_one_token_calls(engine):
    """A row with next_seeds returns what as many one-token verifies would: a greedy prompt
    decoding 4 tokens and a sampling decode row 3, beside a drafted row that decodes one."""
    sampled = SamplingParams(temperature=0.9, top_k=50)
    prompt, other = seq(12, 20), seq(9, 21)

    def start():
        a, b, c = engine.allocate(), engine.allocate(), engine.allocate()
        engine.verify([row(b, 0, other, params=sampled), row(c, 0, seq(7, 22))])
        return a, b, c

    a, b, c = start()
    multi = engine.verify(
        [
            dataclasses.replace(row(a, 0, prompt), round_seed=1, next_seeds=np.array([2, 3, 4])),
            dataclasses.replace(
                row(b, 9, [int(other[-1])], params=sampled),
                round_seed=11,
                next_seeds=np.array([12, 13]),
            ),
            row(c, 7, seq(4, 23), k=3),
        ]
    )
    lengths = [engine.length(s) for s in (a, b, c)]
    for s in (a, b, c):
        engine.release(s)

    a, b, c = start()
    ref_a = [engine.verify([dataclasses.replace(row(a, 0, prompt), round_seed=1)])[0]]
    ref_b = [
        engine.verify(
            [dataclasses.replace(row(b, 9, [int(other[-1])], params=sampled), round_seed=11)]
        )[0]
    ]
    ref_c = engine.verify([row(c, 7, seq(4, 23), k=3)])[0]
    for seed in (2, 3, 4):
        ref_a.append(
            engine.verify(
                [
                    dataclasses.replace(
                        row(a, engine.length(a), [int(ref_a[-1].argmax[-1])]), round_seed=seed
                    )
                ]
            )[0]
        )
    for seed in (12, 13):
        ref_b.append(
            engine.verify(
                [
                    dataclasses.replace(
                        row(b, engine.length(b), [int(ref_b[-1].residual[-1])], params=sampled),
                        round_seed=seed,
                    )
                ]
            )[0]
        )
    assert lengths == [engine.length(s) for s in (a, b, c)] == [15, 12, 11]
    for got, ref in ((multi[0], ref_a), (multi[1], ref_b)):
        np.testing.assert_array_equal(got.argmax, np.concatenate([r.argmax for r in ref]))
        np.testing.assert_array_equal(got.residual, np.concatenate([r.residual for r in ref]))
        assert rel_err(got.features, np.concatenate([r.features for r in ref])) < 1e-5
    assert len(multi[0].argmax) == 4 and multi[0].features.shape[0] == 12 + 3
    assert (multi[1].residual >= 0).all() and multi[1].features.shape[0] == 1 + 2
    np.testing.assert_array_equal(multi[2].argmax, ref_c.argmax)


def test_rows_without_features_get_the_same_statistics_and_no_features(engine):
    """features=False rows (sequences that never draft) beside rows with features, in one
    packed verify and through further steps: the same argmax, residuals and, for the rows that
    want them, features as a verify where every row returns features; the others get [0, F]."""
    sampled = SamplingParams(temperature=0.9, top_k=50)

    def run(features: bool):
        a, b, c = engine.allocate(), engine.allocate(), engine.allocate()
        first = engine.verify(
            [
                dataclasses.replace(row(a, 0, seq(12, 30)), features=features),
                row(b, 0, seq(9, 31), params=sampled),
                row(c, 0, seq(7, 32)),
            ]
        )
        second = engine.verify(
            [
                dataclasses.replace(
                    row(a, 12, [int(first[0].argmax[-1])]),
                    round_seed=5,
                    next_seeds=np.array([6, 7]),
                    features=features,
                ),
                dataclasses.replace(
                    row(b, 9, [int(first[1].residual[-1])], params=sampled),
                    round_seed=8,
                    next_seeds=np.array([9]),
                ),
                row(c, 7, seq(4, 33), k=3),
            ]
        )
        for s in (a, b, c):
            engine.release(s)
        return first + second

    full, lean = run(True), run(False)
    for i, (f, g) in enumerate(zip(full, lean)):
        np.testing.assert_array_equal(f.argmax, g.argmax)
        np.testing.assert_array_equal(f.residual, g.residual)
        if i % 3 == 0:  # row a
            assert g.features.shape == (0, f.features.shape[1]) and f.features.shape[0] > 0
        else:
            np.testing.assert_array_equal(f.features, g.features)


def test_a_row_fetches_the_features_earlier_rows_went_without(engine, model):
    """Rows without features (a prefill, a multi-step decode, a tree verify's winner) leave
    their features in the engine; a later row with features_from gets every position's
    features from there on, equal to what rows with features returned."""
    prompt = seq(14, 40)

    def run(features: bool):
        a = engine.allocate()
        out = [engine.verify([dataclasses.replace(row(a, 0, prompt), features=features)])[0]]
        out.append(
            engine.verify(
                [
                    dataclasses.replace(
                        row(a, 14, [int(out[0].argmax[-1])]),
                        next_seeds=np.array([1, 2]),
                        features=features,
                    )
                ]
            )[0]
        )
        anchor = int(out[1].argmax[-1])
        res, path = engine.verify_tree(
            tree_row(a, 17, anchor, [seq(3, 41), seq(3, 42), seq(3, 43)])
        )
        out.append(res)
        last = engine.verify(
            [
                dataclasses.replace(
                    row(a, 18 + len(path), [int(res.argmax[-1])]),
                    features_from=0 if not features else -1,
                )
            ]
        )[0]
        engine.release(a)
        return out, last, len(path)

    (full, full_last, n), (lean, lean_last, _) = run(True), run(False)
    assert lean[0].features.shape[0] == lean[1].features.shape[0] == 0
    # The tree's accepted path is kept at the row's positions; a tree row always returns its features.
    expected = np.concatenate(
        [full[0].features, full[1].features, full[2].features, full_last.features]
    )
    assert lean_last.features.shape == expected.shape == (19 + n, engine.feature_dim)
    assert rel_err(lean_last.features, expected) < 1e-5
    a = engine.allocate()
    engine.verify([row(a, 0, prompt)])
    for bad in (
        dataclasses.replace(row(a, 14, [5]), features_from=15),
        dataclasses.replace(row(a, 14, [5]), features_from=3, features=False),
    ):
        with pytest.raises(InvalidRequest, match="features_from"):
            engine.verify([bad])
    engine.release(a)


def test_tree_verify_equals_verifying_the_accepted_path_alone(model):
    """Blocks after one anchor verified as one tree (a trie: shared prefixes once): the result,
    the cache and the kept features are those of a plain verify of the accepted path."""
    prompt, K = seq(30, 12), 6
    ref = fresh_engine(model)
    slot = ref.allocate()
    greedy = [
        int(ref.verify([row(slot, 0, prompt)])[0].argmax[-1])
    ]  # the anchor, then its continuation
    for i in range(K):
        greedy.append(int(ref.verify([row(slot, 30 + i, greedy[-1:])])[0].argmax[-1]))
    anchor, cont = greedy[0], np.array(greedy[1:])
    rnd = (cont[None] + 1 + seq(3 * K, 13).reshape(3, K)) % V  # never the continuation
    blocks = [
        rnd[0],
        np.r_[cont[:4], rnd[1, 4:]],
        np.r_[cont[:2], rnd[2, 2:]],
    ]  # block 1 goes furthest; blocks 1 and 2 share their first two tokens
    t = tree_row(0, 30, anchor, blocks)
    assert t.num_draft == 3 * K - 2 and t.parents.tolist()[K : K + 2] == [-1, K]

    tree = fresh_engine(model)
    a = tree.allocate()
    tree.verify([row(a, 0, prompt)])
    res, path = tree.verify_tree(tree_row(a, 30, anchor, blocks))
    assert t.tokens[1 + path].tolist() == cont[:4].tolist() and tree.length(a) == 30 + 1 + 4
    alone = fresh_engine(model)
    b = alone.allocate()
    alone.verify([row(b, 0, prompt)])
    want = alone.verify([row(b, 30, np.r_[anchor, cont[:4]], k=4)])[0]
    np.testing.assert_array_equal(res.argmax, want.argmax)
    assert res.support_probs.shape == (0, 1) and (res.residual == -1).all()
    assert res.features.shape == want.features.shape and rel_err(res.features, want.features) < 1e-5
    # The path's K/V now sit at the row's positions: the next round sees the same cache.
    nxt = np.r_[cont[4:], seq(4, 14)]
    got = tree.verify([row(a, 31 + 4, nxt, k=3)])[0]
    ref_next = alone.verify([row(b, 31 + 4, nxt, k=3)])[0]
    np.testing.assert_array_equal(got.argmax, ref_next.argmax)
    assert rel_err(got.features, ref_next.features) < 1e-5
    # A tree none of whose first tokens is the argmax accepts nothing; bad input is refused.
    res0, path0 = tree.verify_tree(tree_row(a, 30, anchor, [rnd[0]]))
    assert len(path0) == 0 and res0.argmax.tolist() == [cont[0]] and tree.length(a) == 31
    bad = tree_row(a, 30, anchor, blocks)
    bad.parents = np.r_[bad.parents[1:], 0]
    with pytest.raises(InvalidRequest, match="parents"):
        tree.verify_tree(bad)

    # At T > 0 the target's samples pick the path; two tree rows in one pass are each what
    # they are alone (two slots with the same prompt, the same seeds).
    hot = SamplingParams(temperature=1.0)
    trees = [
        tree_row(0, 30, anchor, blocks, params=hot),
        tree_row(1, 30, anchor, blocks[:2], params=hot),
    ]
    two = fresh_engine(model, n_slots=2)
    for s_ in (two.allocate(), two.allocate()):
        two.verify([row(s_, 0, prompt)])
    both = two.verify_trees(trees)
    for t_row, (res_t, path_t) in zip(trees, both):
        assert len(res_t.residual) == len(path_t) + 1 and (res_t.residual >= 0).all()
        one_engine = fresh_engine(model)
        d = one_engine.allocate()
        one_engine.verify([row(d, 0, prompt)])
        one, one_path = one_engine.verify_tree(replace(t_row, slot=d))
        assert one_path.tolist() == path_t.tolist()
        assert one.residual.tolist() == res_t.residual.tolist()
        assert rel_err(one.features, res_t.features) < 1e-5


def test_incremental_decoding_equals_one_forward(engine, model, hf_models):
    tokens = seq(25, 10)
    slot = engine.allocate()
    steps = [engine.verify([row(slot, 0, tokens[:10])])[0]]
    for i in range(10, 25):
        steps.append(engine.verify([row(slot, i, tokens[i : i + 1])])[0])
    argmax = [int(r.argmax[0]) for r in steps]  # next-token argmax after positions 9..24
    feats = np.concatenate([r.features for r in steps])

    fresh = fresh_engine(model)
    full = fresh.verify([row(fresh.allocate(), 0, tokens, k=15)])[0]
    logits, _ = hf_forward(hf_models["gqa"], tokens)
    assert_clear_argmax(logits[9:])
    assert argmax == full.argmax.tolist() == logits[9:].argmax(-1).tolist()
    assert rel_err(feats, full.features) < 1e-5


# -- verification statistics ---------------------------------------------------------


def hf_probs(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    x = TemperatureLogitsWarper(t)(None, logits.clone())
    if k:
        x = TopKLogitsWarper(k)(None, x)
    if p < 1:
        x = TopPLogitsWarper(p)(None, x)
    return x.softmax(-1)


def test_process_logits_matches_transformers_warpers():
    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 3
    logits[5, :3] = 10.0  # a tie at the top-k boundary: every tied token stays
    params = [
        (1.0, 0, 1.0),
        (0.7, 50, 1.0),
        (1.3, 0, 0.9),
        (0.5, 20, 0.8),
        (1.0, 0, 1e-4),
        (1.0, 2, 1.0),
    ]
    t, k, p = (torch.tensor(x) for x in zip(*params))
    got = process_logits(logits, t.float(), k, p.double())
    for i, (ti, ki, pi) in enumerate(params):
        torch.testing.assert_close(
            got[i], hf_probs(logits[i : i + 1], ti, ki, pi)[0], rtol=1e-5, atol=1e-7
        )
    assert (got[4] > 0).sum() == 1  # top_p tiny keeps exactly the top token
    assert (got[5] > 0).sum() == 3 and (got[1] > 0).sum() == 50


def synthetic_rows(n_rows, supports, params, seed0=0):
    """Rows for verification_stats with given per-position supports (tokens are unused)."""
    sup = np.asarray(supports, np.int64)
    return [
        VerifyRow(0, 0, np.zeros(len(sup) + 1, np.int64), params, sup, seed0 + i)
        for i in range(n_rows)
    ]


def test_support_probs_complement_and_seeded_samples():
    torch.manual_seed(1)
    params = SamplingParams(temperature=0.9, top_k=30, top_p=0.9)
    supports = [[4, 9, -1], [-1, -1, -1], [7, -1, 2]]
    base = torch.randn(4, 64) * 2
    base[0, [4, 9]] += 3  # make the support carry real mass
    rows = synthetic_rows(3, supports, params)
    stats = verification_stats(base.repeat(3, 1), rows)
    ref = hf_probs(base, 0.9, 30, 0.9)
    sup = np.asarray(supports)
    want = np.where(sup >= 0, ref[:3].numpy()[np.arange(3)[:, None], np.maximum(sup, 0)], 0.0)
    for st in stats:
        np.testing.assert_allclose(st.support_probs, want, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(st.complement, 1 - want.sum(1), atol=1e-5)
        np.testing.assert_array_equal(st.argmax, base.argmax(-1).numpy())
        for kk, y in enumerate(st.residual):
            assert y >= 0 and ref[kk, y] > 0  # never a filtered-out token
            if kk < 3:
                assert y not in sup[kk]
    again = verification_stats(base.repeat(3, 1), rows)
    for a, b in zip(stats, again):
        np.testing.assert_array_equal(a.residual, b.residual)
    assert len({tuple(s.residual) for s in stats}) > 1  # different seeds, different samples

    # Support holding all the mass: no residual to sample (c = 0, y = -1).
    peaked = torch.full((2, 16), -200.0)
    peaked[:, 3] = 0.0
    st = verification_stats(peaked, synthetic_rows(1, [[3]], SamplingParams(temperature=1.0)))[0]
    assert st.residual.tolist() == [-1, 3] and st.complement.tolist() == [0.0]


def test_greedy_rows_have_argmax_only():
    logits = torch.randn(5, 32)
    rows = [
        row(0, 0, np.zeros(3), k=2),
        row(1, 0, np.zeros(1), params=SamplingParams(temperature=1.0)),
    ]
    g, s = verification_stats(torch.cat([logits[:3], logits[3:4]]), rows)
    assert g.argmax.tolist() == logits[:3].argmax(-1).tolist()
    assert (
        g.support_probs.shape == (0, 1)
        and g.complement.shape == (0,)
        and g.residual.tolist() == [-1] * 3
    )
    assert s.support_probs.shape == (0, 1) and s.residual.shape == (1,) and s.residual[0] >= 0


def test_argmax_ids_matches_torch_on_ties_and_nan():
    logits = torch.randn(6, 50)
    logits[1, [3, 7]] = 10.0  # tie: the first index wins
    logits[2] = 0.0
    logits[3, [5, 9]] = float("nan")  # NaN is the maximum, the first one
    logits[4, 0] = float("inf")
    assert argmax_ids(logits).tolist() == logits.argmax(-1).tolist()
    assert argmax_ids(logits).dtype == np.int64


def test_residual_and_bonus_follow_the_target_distribution():
    stats_mod = pytest.importorskip("scipy.stats")
    torch.manual_seed(2)
    Vs, n = 12, 3000
    base = torch.randn(2, Vs)
    support = [[0, 5]]
    params = SamplingParams(temperature=1.2, top_k=10)
    stats = verification_stats(base.repeat(n, 1), synthetic_rows(n, support, params, seed0=1000))
    p = hf_probs(base, 1.2, 10, 1.0).double().numpy()
    residual_p = p[0].copy()
    residual_p[support[0]] = 0
    for pos, target in ((0, residual_p), (1, p[1])):
        counts = np.bincount([s.residual[pos] for s in stats], minlength=Vs)
        assert counts[target == 0].sum() == 0  # never the support, never a top-k-filtered token
        keep = target > 0
        expected = target[keep] / target[keep].sum() * n
        assert stats_mod.chisquare(counts[keep], expected).pvalue > 1e-3


# -- validation and slots ------------------------------------------------------------


def test_invalid_requests(engine):
    a, b = engine.allocate(), engine.allocate()
    engine.verify([row(a, 0, seq(10))])
    ok = dict(slot=a, start_pos=10, tokens=np.array([1, 2, 3]), params=GREEDY)
    bad = [
        dict(tokens=np.zeros(0, np.int64)),
        dict(tokens=np.array([1, V])),
        dict(tokens=np.array([-1, 2])),
        dict(tokens=np.array([1.5, 2.0])),
        dict(start_pos=-1),
        dict(start_pos=11),
        dict(start_pos=10, tokens=np.zeros(119, np.int64)),  # 129 > max_seq_len 128
        dict(slot=3),  # not allocated
        dict(slot=99),
        dict(support_ids=np.array([[1], [2], [3]])),  # K+1 = 4 > L = 3
        dict(support_ids=np.array([[1, 1]])),
        dict(
            support_ids=np.array([[1, -1, -1], [2, -1, 2]])
        ),  # a repeat in slot 1, padding around it
        dict(support_ids=np.array([[V]])),
        dict(params=SamplingParams(temperature=-1.0)),
        dict(params=SamplingParams(top_p=0.0)),
        dict(
            tokens=np.array([1, 2]), support_ids=np.array([[2]]), next_seeds=np.array([5])
        ),  # drafts: one step
        dict(
            start_pos=10, tokens=np.zeros(100, np.int64), next_seeds=np.arange(19)
        ),  # 10 + 100 + 19 > 128
        dict(next_seeds=np.arange(MAX_PLAIN_TOKENS)),
        dict(next_seeds=np.zeros((2, 2), np.int64)),
    ]
    lengths = (engine.length(a), engine.length(b))
    for change in bad:
        with pytest.raises(InvalidRequest) as e:
            engine.verify([VerifyRow(**{**ok, **change})])
        assert "\n" not in str(e.value) and str(e.value).startswith("row 0: ")
    with pytest.raises(InvalidRequest, match="twice"):
        engine.verify([row(b, 0, seq(3)), row(a, 10, seq(3)), row(b, 0, seq(3))])
    assert (engine.length(a), engine.length(b)) == lengths  # nothing ran
    # Padding may repeat: this row is valid.
    engine.verify([VerifyRow(**{**ok, "support_ids": np.array([[1, -1, -1], [2, 3, -1]])})])
    assert engine.length(a) == 13


def test_slots_allocate_release(engine):
    assert [engine.allocate() for _ in range(4)] == [0, 1, 2, 3] and engine.free_slots == 0
    with pytest.raises(NoFreeSlot):
        engine.allocate()
    engine.verify([row(2, 0, seq(5))])
    engine.release(2)
    assert engine.free_slots == 1
    with pytest.raises(InvalidRequest):
        engine.release(2)
    with pytest.raises(InvalidRequest):
        engine.length(2)
    assert engine.allocate() == 2 and engine.length(2) == 0


# -- config parsing and the random checkpoint ----------------------------------------

BASE_CFG = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
)


def test_config_parsing_variants():
    old = Qwen3Config.from_dict(
        {**BASE_CFG, "rope_theta": 1e6, "rope_scaling": None, "eos_token_id": 7}
    )
    assert (old.rope_theta, old.head_dim, old.eos_token_id) == (1e6, 16, (7,))
    rope = {"rope_type": "default", "rope_theta": 5e5}
    new = Qwen3Config.from_dict({**BASE_CFG, "head_dim": 32, "rope_parameters": rope})
    assert (new.rope_theta, new.head_dim, new.eos_token_id) == (5e5, 32, ())
    for bad in (
        {"rope_scaling": {"type": "yarn", "factor": 4.0}},
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}},
        {"attention_bias": True},
        {"use_sliding_window": True},
        {"vocab_size": None},
    ):
        with pytest.raises(CheckpointError):
            Qwen3Config.from_dict({**BASE_CFG, **bad})
    with pytest.raises(CheckpointError, match="hidden_size"):
        Qwen3Config.from_dict({k: v for k, v in BASE_CFG.items() if k != "hidden_size"})


def test_random_checkpoint_is_seeded_and_leaves_global_rng(tmp_path, checkpoints):
    from safetensors.torch import load_file

    state = torch.random.get_rng_state()
    path = make_random_qwen3(tmp_path / "again", with_tokenizer=False)
    assert torch.equal(state, torch.random.get_rng_state())
    a, b = (
        load_file(path / "model.safetensors"),
        load_file(checkpoints["gqa"] / "model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tok = transformers.AutoTokenizer.from_pretrained(checkpoints["gqa"])
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok("The sky is blue.")["input_ids"]) == "The sky is blue."


@pytest.mark.unit
def test_kept_features_handed_back_are_copies():
    """The in-process drafter holds fetched features until its next call: a later write to the
    slot (a rebuilt cache, the slot handed to another sequence) must not change them."""
    from target_service.kept_features import KeptFeatures

    kept = KeptFeatures(2, 8, 1, 4, torch.float32, torch.device("cpu"))
    kept._features[0, :3] = 1.0
    on_device, on_host = kept.before(0, 0, 3, True), kept.before(0, 0, 3, False)
    kept._features[0, :3] = 2.0
    assert float(on_device.sum()) == 12.0 and float(on_host.sum()) == 12.0
