"""Losslessness of speculative decoding, end to end in one process.

Temperature 0: speculative output == our engine alone == a plain greedy loop over
transformers' Qwen3ForCausalLM, for 3 random tiny configs x 20 prompts x 1 and 2
draft steps, with the untrained FlashMap drafter and with an oracle drafter that
proposes the target's own continuation with an error injected at a chosen slot (so a
full accept and a rejection at every slot 1..16 are exercised).

Near-ties: the reference loop records the top-2 logit gap at every generated
position; the test asserts it stays far above fp32 rounding (1e-4), so an argmax
flip between a (K+1)-row verify and a one-row step cannot explain a pass or a fail.

Temperature > 0: on a tiny-vocabulary model (V=8) the exact law of the first 3
generated tokens is enumerated from transformers' logits (all 8^2 prefixes, one
batched forward) and 12,000 speculative samples are chi-square tested against it.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from drafter_service.factory import load_proposer
from drafter_service.oracle import OracleProposer
from flashmap.inprocess import decode
from flashmap.speculation import ControllerConfig, SpeculationController
from flashmap.types import GenerationRequest, SamplingParams
from target_service.engine import TargetEngine
from target_service.random_checkpoint import make_random_qwen3

CONFIGS = {
    "4L-gqa2-untied": dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False
    ),
    "2L-mha-tied": dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True
    ),
    "6L-gqa4-untied": dict(
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
    ),
}
N_PROMPTS, MAX_NEW = 20, 24


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=rng.integers(3, 20)).tolist() for _ in range(N_PROMPTS)]


def _hf_greedy(model_dir, prompts, max_new):
    """Plain greedy loop over transformers' model (full forward each step): the reference."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs, min_gap = [], np.inf
    with torch.inference_mode():
        for p in prompts:
            ids = list(p)
            for _ in range(max_new):
                logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
                top2 = torch.topk(logits, 2).values
                min_gap = min(min_gap, float(top2[0] - top2[1]))
                ids.append(int(logits.argmax()))
            outs.append(ids[len(p) :])
    return outs, min_gap


@pytest.fixture(scope="module", params=list(CONFIGS))
def target(request, tmp_path_factory):
    path = make_random_qwen3(
        tmp_path_factory.mktemp(request.param),
        with_tokenizer=False,
        seed=len(request.param),
        **CONFIGS[request.param],
    )
    engine = TargetEngine(path, n_slots=N_PROMPTS)
    prompts = _prompts(engine.vocab_size, seed=len(request.param))
    reference, min_gap = _hf_greedy(path, prompts, MAX_NEW)
    assert min_gap > 1e-4, f"near-tie in the reference (top-2 gap {min_gap:.2e}): pick another seed"
    return SimpleNamespace(
        name=request.param, path=path, engine=engine, prompts=prompts, reference=reference
    )


def _requests(prompts):
    return [GenerationRequest(p, MAX_NEW, SamplingParams()) for p in prompts]


def test_engine_alone_matches_transformers(target):
    engine, prompts, reference = target.engine, target.prompts, target.reference
    out = decode(engine, _requests(prompts))
    assert [r.token_ids for r in out] == reference


@pytest.mark.parametrize("steps", [1, 2])
def test_untrained_drafter_is_lossless(target, steps):
    path, engine, prompts, reference = target.path, target.engine, target.prompts, target.reference
    proposer = load_proposer(
        "init", str(path), n_slots=N_PROMPTS, max_context=engine.max_seq_len, steps=steps
    )
    out = decode(engine, _requests(prompts), proposer, draft_steps=steps)
    assert [r.token_ids for r in out] == reference
    assert all(r.stats.drafts > 0 for r in out)


def test_multi_step_decoding_is_lossless(target):
    """Rounds without drafts decoding several tokens per call (alone, and between drafted
    rounds as the goodput controller switches) give the reference text; a seeded sampling
    request gives the same text as with one token per call."""
    path, engine, prompts, reference = target.path, target.engine, target.prompts, target.reference
    assert [r.token_ids for r in decode(engine, _requests(prompts), plain_tokens=5)] == reference
    proposer = load_proposer("init", str(path), n_slots=N_PROMPTS, max_context=engine.max_seq_len)
    out = decode(
        engine,
        _requests(prompts),
        proposer,
        controller=SpeculationController(proposer.block_size, ControllerConfig(plain_tokens=4)),
        plain_tokens=4,
    )
    assert [r.token_ids for r in out] == reference
    sampled = lambda: [
        GenerationRequest(p, MAX_NEW, SamplingParams(0.8, top_k=20, seed=i))  # noqa: E731
        for i, p in enumerate(prompts)
    ]
    one = decode(engine, sampled())
    assert [r.token_ids for r in decode(engine, sampled(), plain_tokens=3)] == [
        r.token_ids for r in one
    ]


def test_rows_without_features_while_speculation_is_off_are_lossless(target, monkeypatch):
    """With lazy_features the controller's rounds without drafts send no features; a request
    chosen to draft again first fetches them (features_from) and then drafts. The text is the
    reference's, and the drafter's context is whole whenever it drafts."""
    path, engine, prompts, reference = target.path, target.engine, target.prompts, target.reference
    proposer = load_proposer("init", str(path), n_slots=N_PROMPTS, max_context=engine.max_seq_len)
    rows, verify = [], engine.verify
    monkeypatch.setattr(
        engine, "verify", lambda batch, **kw: rows.extend(batch) or verify(batch, **kw)
    )
    controller = SpeculationController(
        proposer.block_size,
        ControllerConfig(plain_tokens=4, lazy_features=True, probe_every=8, max_probe_every=8),
    )
    out = decode(engine, _requests(prompts), proposer, controller=controller, plain_tokens=4)
    assert [r.token_ids for r in out] == reference
    assert any(not r.features for r in rows if r.start_pos > 0), "no round went without features"
    assert any(r.features_from >= 0 for r in rows), "no row fetched the features it went without"
    assert sum(r.stats.drafts for r in out) > 0


def test_oracle_full_accept_and_rejection_at_every_slot(target):
    engine, prompts, reference = target.engine, target.prompts, target.reference
    # The 16 error slots are split over the three configs (every slot is covered once).
    config_index = list(CONFIGS).index(target.name)
    refs = [p + r for p, r in zip(prompts, reference)]
    block = 16
    # No errors: every round accepts the whole block (or what max_new_tokens leaves).
    out = decode(engine, _requests(prompts), OracleProposer(refs, block, engine.vocab_size))
    assert [r.token_ids for r in out] == reference
    first_round = [r.stats.accepted_per_slot for r in out]
    assert all(a[block - 1] >= 1 for a in first_round), "a full block of 16 was never accepted"
    for slot in range(1 + config_index, block + 1, len(CONFIGS)):
        out = decode(
            engine,
            _requests(prompts),
            OracleProposer(refs, block, engine.vocab_size, error_slots=[slot]),
        )
        assert [r.token_ids for r in out] == reference, f"error at slot {slot} changed the output"
        for r in out:
            # Every round rejects at the error slot; all slots before it are accepted, except
            # in a last round whose token budget was shorter than the block.
            assert r.stats.accepted_per_slot[slot - 1] == 0
            if slot > 1:
                assert 0 < r.stats.accepted_per_slot[0] - r.stats.accepted_per_slot[
                    slot - 2
                ] <= 1 or (r.stats.accepted_per_slot[0] == r.stats.accepted_per_slot[slot - 2] > 0)


@pytest.mark.slow
def test_tree_verification_is_lossless_and_takes_the_accepted_path(target):
    path, engine, prompts, reference = target.path, target.engine, target.prompts, target.reference
    refs = [p + r for p, r in zip(prompts, reference)]
    oracle = lambda: OracleProposer(refs, 16, engine.vocab_size, error_rate=0.15, seed=3)  # noqa: E731
    chain = decode(engine, _requests(prompts), oracle())
    tree = decode(engine, _requests(prompts), oracle(), tree_blocks=3)
    assert [r.token_ids for r in chain] == reference
    assert [r.token_ids for r in tree] == reference
    # Branch 0 is the chain's draft; two more blocks with their own errors can only help.
    acc = lambda out: sum(r.stats.accepted for r in out) / sum(r.stats.drafts for r in out)  # noqa: E731
    assert acc(tree) > acc(chain)
    # The FlashMap drafter's blocks from independent noise, 1 and 2 jumps.
    for steps in (1, 2):
        proposer = load_proposer(
            "init", str(path), n_slots=N_PROMPTS, max_context=engine.max_seq_len, steps=steps
        )
        out = decode(engine, _requests(prompts), proposer, draft_steps=steps, tree_blocks=4)
        assert [r.token_ids for r in out] == reference
    # Drafts cut short by the drafter's confidence (any length is exact), alone and in a tree.
    proposer = load_proposer("init", str(path), n_slots=N_PROMPTS, max_context=engine.max_seq_len)
    proposer.min_confidence = 0.3
    for tree_blocks in (1, 3):
        out = decode(engine, _requests(prompts), proposer, tree_blocks=tree_blocks)
        assert [r.token_ids for r in out] == reference
        assert sum(r.stats.draft_tokens for r in out) < 16 * tree_blocks * sum(
            r.stats.drafts for r in out
        )


# --------------------------------------------------------------------------------------------
# temperature > 0: the law of the first 3 tokens on a tiny-vocabulary model
V_TINY, N_SAMPLES, BATCH = 8, 12_000, 400


def _exact_first3(model_dir, prompt, params: SamplingParams):
    """P(t1, t2, t3) by enumeration, after the same temperature / top-k / top-p processing."""
    from transformers import Qwen3ForCausalLM

    from target_service.verification import process_logits

    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pairs = torch.cartesian_prod(torch.arange(V_TINY), torch.arange(V_TINY))  # [64, 2]
    seqs = torch.cat([torch.tensor(prompt).expand(len(pairs), -1), pairs], dim=1)
    with torch.inference_mode():
        logits = model(seqs, use_cache=False).logits[:, -3:]  # [64, 3, V]: after prompt, t1, t2
    n = logits.shape[0] * 3
    probs = (
        process_logits(
            logits.reshape(n, -1),
            torch.full((n,), params.temperature),
            torch.full((n,), params.top_k),
            torch.full((n,), params.top_p),
        )
        .reshape(len(pairs), 3, -1)
        .double()
    )
    p1 = probs[0, 0]  # the same in every row
    p2 = probs[torch.arange(0, len(pairs), V_TINY), 1]  # [t1, V]
    p3 = probs[:, 2].reshape(V_TINY, V_TINY, V_TINY)  # [t1, t2, V]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return joint.reshape(-1).numpy()


def _tiny_vocab_target(tmp_path, layers: int = 2):
    return make_random_qwen3(
        tmp_path / "tiny-vocab",
        vocab_size=V_TINY,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        with_tokenizer=False,
        seed=3,
        init_std=0.3,
    )


def _first3_counts(engine, prompt, params, seed0: int, **decode_kw) -> tuple[np.ndarray, int]:
    """Counts of the first 3 tokens over N_SAMPLES seeded requests, and drafts accepted."""
    counts = np.zeros(V_TINY**3)
    accepted = 0
    for b in range(N_SAMPLES // BATCH):
        reqs = [
            GenerationRequest(
                prompt,
                3,
                SamplingParams(
                    params.temperature, params.top_k, params.top_p, seed=seed0 + b * BATCH + i
                ),
            )
            for i in range(BATCH)
        ]
        for r in decode(engine, reqs, **decode_kw):
            t1, t2, t3 = r.token_ids
            counts[(t1 * V_TINY + t2) * V_TINY + t3] += 1
            accepted += r.stats.accepted
    return counts, accepted


def _assert_follows(counts: np.ndarray, exact: np.ndarray, min_p: float = 1e-3) -> None:
    """Chi-square of the counts against the exact law (bins under 5 expected pooled)."""
    expected = exact * N_SAMPLES
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 1e-9:  # nothing to pool
        obs, exp = obs[:-1], exp[:-1]
    assert counts[exact == 0].sum() == 0, "sampled a sequence the target gives probability 0"
    assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > min_p


@pytest.mark.parametrize(
    "params",
    [SamplingParams(1.0), SamplingParams(0.7, top_k=5, top_p=0.9)],
    ids=["T1", "T0.7-k5-p0.9"],
)
@pytest.mark.slow
def test_first_three_tokens_follow_the_target(tmp_path, params):
    path = _tiny_vocab_target(tmp_path)
    prompt = [1, 5, 2]
    exact = _exact_first3(path, prompt, params)
    engine = TargetEngine(path, n_slots=BATCH)
    torch.manual_seed(0)  # the fresh drafter's weights: the statistical test is then reproducible
    proposer = load_proposer("init", str(path), n_slots=BATCH, max_context=64)
    counts, accepted = _first3_counts(engine, prompt, params, 0, proposer=proposer)
    assert accepted > 0, "no draft token was ever accepted: the test would not exercise acceptance"
    _assert_follows(counts, exact)


@pytest.mark.slow
def test_multi_step_samples_follow_the_target(tmp_path):
    """The target alone decoding tokens 2 and 3 in one call (plain_tokens) samples the target's law."""
    path = _tiny_vocab_target(tmp_path)
    params = SamplingParams(1.0)
    engine = TargetEngine(path, n_slots=BATCH)
    counts, _ = _first3_counts(engine, [1, 5, 2], params, 10**6, plain_tokens=2)
    _assert_follows(counts, _exact_first3(path, [1, 5, 2], params))


# Trees at T > 0 (target_service.tree): deep, wide, and with shared prefixes. Their tokens come
# from the drafter's own randomness, so the target's pick at each node decides the text.
TREES = {
    "deep": [-1, 0, 1, 2, 3],
    "wide": [-1, -1, -1, -1, -1, -1],
    "shared": [-1, 0, 0, 1, 1, -1, 5, 6],
}


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(TREES))
@pytest.mark.parametrize(
    "params",
    [SamplingParams(1.0), SamplingParams(0.7, top_k=5, top_p=0.9)],
    ids=["T1", "T0.7-k5-p0.9"],
)
def test_trees_at_t_above_zero_follow_the_target(tmp_path, shape, params):
    from tests.drafter_helpers import TreeProposer

    path = _tiny_vocab_target(tmp_path)
    prompt = [1, 5, 2]
    engine = TargetEngine(path, n_slots=BATCH)
    proposer = TreeProposer(TREES[shape], V_TINY)
    counts, accepted = _first3_counts(engine, prompt, params, 3 * 10**6, proposer=proposer)
    assert accepted > 0, "no draft token was ever accepted: the test would not exercise acceptance"
    _assert_follows(counts, _exact_first3(path, prompt, params), min_p=0.01)


@pytest.mark.slow
@pytest.mark.parametrize(
    "tree_sampling,blocks,depth",
    [
        ("pick", 3, 0),
        ("rejection", 3, 0),
        ("siblings", 3, 0),
        ("siblings", 1, 0),
        ("siblings", 1, 2),
    ],
    ids=["pick", "rejection", "siblings", "siblings-1", "siblings-1-d2"],
)
@pytest.mark.parametrize(
    "params",
    [SamplingParams(1.0), SamplingParams(0.7, top_k=5, top_p=0.9)],
    ids=["T1", "T0.7-k5-p0.9"],
)
def test_blocks_with_a_proposal_law_follow_the_target(
    tmp_path, tree_sampling, blocks, depth, params
):
    """tree_blocks = 3 at T > 0, each block drawn from a proposal law of its own: merged into one
    tree the target follows ("pick"), as three chains verified by multi-draft rejection
    sampling with their q ("rejection"), or that with each drafted token's other support
    tokens as leaves beside it ("siblings", also for one block; beside the first 2 depths only),
    in one pass."""
    from tests.drafter_helpers import BlockProposer

    path = _tiny_vocab_target(tmp_path)
    engine = TargetEngine(path, n_slots=BATCH)
    counts, accepted = _first3_counts(
        engine,
        [1, 5, 2],
        params,
        5 * 10**6,
        proposer=BlockProposer(V_TINY),
        tree_blocks=blocks,
        tree_sampling=tree_sampling,
        sibling_depth=depth,
    )
    assert accepted > 0
    _assert_follows(counts, _exact_first3(path, [1, 5, 2], params), min_p=0.01)


@pytest.mark.slow
def test_flashmap_blocks_from_independent_noise_follow_the_target(tmp_path):
    """tree_blocks = 4 at T = 1: four blocks of the (untrained) FlashMap drafter, each a chain with
    the law the flow samples from given its noise, verified by multi-draft rejection sampling."""
    path = _tiny_vocab_target(tmp_path)
    params = SamplingParams(1.0)
    engine = TargetEngine(path, n_slots=BATCH)
    torch.manual_seed(0)
    proposer = load_proposer("init", str(path), n_slots=BATCH, max_context=64)
    counts, accepted = _first3_counts(
        engine,
        [1, 5, 2],
        params,
        6 * 10**6,
        proposer=proposer,
        tree_blocks=4,
        tree_sampling="rejection",
    )
    assert accepted > 0
    _assert_follows(counts, _exact_first3(path, [1, 5, 2], params), min_p=0.01)


@pytest.mark.slow
def test_seeded_tree_requests_repeat_and_greedy_trees_stay_exact(target):
    """A seeded T = 1 request verified as trees gives the same text twice; at T = 0 the same
    trees give the target alone's text."""
    from tests.drafter_helpers import TreeProposer

    engine, prompts, reference = target.engine, target.prompts, target.reference
    proposer = TreeProposer(TREES["shared"], engine.vocab_size)
    sampled = [GenerationRequest(p, 24, SamplingParams(1.0, seed=i)) for i, p in enumerate(prompts)]
    first = [r.token_ids for r in decode(engine, sampled, proposer)]
    again = [r.token_ids for r in decode(engine, sampled, proposer)]
    assert first == again
    out = decode(engine, _requests(prompts), proposer)
    assert [r.token_ids for r in out] == reference


def test_second_jump_network_is_lossless(target):
    """A drafter with a second-jump network (DrafterConfig.second_jump_net) drafting T = 0 rows
    from the zero state in two jumps: the output is the target's own."""
    from drafter_service.checkpoint import init_drafter
    from drafter_service.flashmap_proposer import FlashMapProposer, departures_as_trained
    from tests.drafter_helpers import randomize

    path, engine, prompts, reference = target.path, target.engine, target.prompts, target.reference
    model = randomize(
        init_drafter(
            path,
            seed=0,
            dim=64,
            n_blocks=2,
            n_heads=4,
            second_jump_net=True,
            null_jump_fraction=0.5,
        )
    )
    randomize(model.second_jump, seed=1)
    proposer = FlashMapProposer(
        model,
        n_slots=N_PROMPTS,
        max_context=engine.max_seq_len,
        steps=2,
        **departures_as_trained(model.cfg),  # the zero state, the second-jump network
    )
    assert proposer.second_jump is not None
    out = decode(engine, _requests(prompts), proposer, draft_steps=2)
    assert [r.token_ids for r in out] == reference
    assert all(r.stats.drafts > 0 for r in out)
