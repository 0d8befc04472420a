"""What a speculative round costs the host, measured without a GPU: torch ops dispatched per
round (they do not grow with the batch: the drafter's context extension is one pass for
every sequence), bytes per committed token between the processes (the target applies the
drafter's context projection), and the context a drafter writes in one pass equals what it
writes sequence by sequence, in whichever width it comes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bench.gpu_e2e_measure import host_work
from drafter_service.dflash import init_dflash, save_dflash
from drafter_service.dflash_proposer import DFlashProposer
from drafter_service.eagle3 import init_eagle3, save_eagle3
from drafter_service.eagle3_proposer import Eagle3Proposer
from drafter_service.factory import load_model, load_proposer, make_proposer
from drafter_service.flashmap_proposer import FlashMapProposer, departures_as_trained
from flashmap.drafter_inputs import ContextProjection, read_context_projection
from flashmap.drafts import ProposeRequest
from flashmap.inprocess import LocalTarget
from flashmap.target_wire import packed_outputs, verify_outputs
from flashmap.types import GenerationRequest, SamplingParams, VerifyResult, VerifyRow
from flashmap.wire import features_to_tensor
from target_service.engine import TargetEngine
from target_service.random_checkpoint import make_random_qwen3

ROOT = Path(__file__).resolve().parent.parent
DEMO_TARGET, DEMO_FLASHMAP = ROOT / "checkpoints/demo-target", ROOT / "checkpoints/demo-flashmap"


def test_ops_per_round_do_not_grow_with_the_batch():
    """The demo target with the demo FlashMap drafter, in process: torch ops dispatched per
    steady-state round at batch 8 are at most 1.1x those at batch 1."""
    torch.set_num_threads(1)
    engine = TargetEngine(DEMO_TARGET, n_slots=8, max_seq_len=256)
    ops = {}
    for b in (1, 8):
        proposer = load_proposer(DEMO_FLASHMAP, DEMO_TARGET, n_slots=8, max_context=256)
        reqs = [
            GenerationRequest(list(range(5 + i, 29 + i)), 40, request_id=f"r{i}") for i in range(b)
        ]
        work = host_work(engine, reqs, proposer, 1, torch.device("cpu"))
        assert work["counted_rounds"] == 3
        ops[b] = work["ops_per_round"]
    print(f"torch ops per round: batch 1 {ops[1]}, batch 8 {ops[8]} ({ops[8] / ops[1]:.3f}x)")
    assert ops[8] <= 1.1 * ops[1], ops


def _wire_bytes(features: np.ndarray) -> tuple[int, int]:
    """Bytes one committed token's features take from Triton to the orchestrator (the packed
    verify answer) and from the orchestrator to the drafter (the Draft stream's tensor)."""
    greedy = lambda f: VerifyResult(np.zeros(1, np.int64), np.zeros((0, 1)), [], [-1], f)  # noqa: E731
    base = len(packed_outputs([verify_outputs(greedy(features), 0, np.float16)]))
    empty = len(packed_outputs([verify_outputs(greedy(features[:0]), 0, np.float16)]))
    return base - empty, features_to_tensor(features.astype(np.float16)).ByteSize()


def test_bytes_per_committed_token_at_the_qwen3_8b_shape():
    """Qwen3-8B's five feature layers (5 x 4,096) against the paper-size FlashMap drafter's
    projection (to its width 2,048): the projected context crosses each hop in >= 4x fewer bytes."""
    rng = np.random.default_rng(0)
    F, D = 5 * 4096, 2048
    proj = ContextProjection(
        rng.standard_normal((D, F), np.float32) / np.sqrt(F), np.ones(D, np.float32), 1e-6
    )
    feats = rng.standard_normal((1, F), np.float32)
    raw = _wire_bytes(feats)
    projected = _wire_bytes(proj(feats))
    print(
        f"bytes per committed token: Triton -> orchestrator {raw[0]} -> {projected[0]}, "
        f"orchestrator -> drafter {raw[1]} -> {projected[1]}"
    )
    assert all(r >= 4 * p for r, p in zip(raw, projected)), (raw, projected)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Qwen3 target and a DFlash and EAGLE-3 drafter for it in the published
    layouts, and the demo FlashMap drafter's shape on its own target."""
    d = tmp_path_factory.mktemp("host_work")
    target = make_random_qwen3(d / "t", num_hidden_layers=6, with_tokenizer=False, seed=2)
    save_dflash(init_dflash(target, num_hidden_layers=2, seed=1), d / "dflash", 6)
    save_eagle3(init_eagle3(target, draft_vocab_size=200, seed=1), d / "eagle3", 6)
    return target, d


def _proposers(tiny):
    target, d = tiny
    from drafter_service.dflash import load_dflash
    from drafter_service.eagle3 import load_eagle3

    yield "flashmap", lambda: FlashMapProposer(load_model(DEMO_FLASHMAP, DEMO_TARGET), n_slots=4)
    yield "dflash", lambda: DFlashProposer(load_dflash(d / "dflash", target), n_slots=4)
    yield "eagle3", lambda: Eagle3Proposer(load_eagle3(d / "eagle3", target), n_slots=4)


@pytest.mark.parametrize("kind", ["flashmap", "dflash", "eagle3"])
def test_one_pass_of_every_sequence_equals_sequence_by_sequence(tiny, kind):
    """Three sequences' new context in one extend_many (in pieces, raw and projected widths
    mixed) leaves the caches and the drafts as extending each sequence alone does."""
    make = dict(_proposers(tiny))[kind]
    one, alone = make(), make()
    rng = np.random.default_rng(3)
    F = one.feature_dim
    lengths = [(5, 3), (9, 1), (2, 4)]
    for round_ in range(2):
        items = []
        for i, pair in enumerate(lengths):
            m = pair[round_]
            ids = rng.integers(0, one.vocab_size, m)
            feats = rng.standard_normal((m, F)).astype(np.float32)
            items.append((f"s{i}", ids, [feats[:1], feats[1:]]))
            alone.extend(f"s{i}", ids, feats)
        if round_ == 1:  # one sequence's context arrives projected, as from a projecting target
            sid, ids, pieces = items[0]
            full = torch.from_numpy(np.concatenate(pieces))
            with torch.no_grad():
                c = (one.model.project_context if kind != "eagle3" else one.model.fuse)(full)
            items[0] = (sid, ids, c)
        assert one.extend_many(items) == {}
    for i in range(3):
        assert one.context_length(f"s{i}") == alone.context_length(f"s{i}") == sum(lengths[i])
    torch.testing.assert_close(one.k_cache, alone.k_cache, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(one.v_cache, alone.v_cache, rtol=1e-4, atol=1e-5)
    reqs = [ProposeRequest(f"s{i}", anchor=7, seed=i) for i in range(3)]
    assert [d.tokens.tolist() for d in one.propose(reqs)] == [
        d.tokens.tolist() for d in alone.propose(reqs)
    ]


def test_extend_many_refuses_a_sequence_without_touching_the_others(tiny):
    make = dict(_proposers(tiny))["dflash"]
    p = make()
    F = p.feature_dim
    ok = (np.arange(3), np.zeros((3, F), np.float32))
    refused = p.extend_many([("a", *ok), ("b", np.arange(2), np.zeros((2, F + 1), np.float32))])
    assert list(refused) == ["b"] and "features must be" in str(refused["b"])
    assert p.context_length("a") == 3 and p.context_length("b") == 0


@pytest.mark.parametrize("kind", ["flashmap", "dflash", "eagle3"])
def test_the_targets_projection_is_the_drafters_own(tiny, kind):
    """flashmap.drafter_inputs reads each layout's projection from its checkpoint: on the host it
    gives what the drafter's own first step gives."""
    target, d = tiny
    drafter_dir = {"flashmap": DEMO_FLASHMAP, "dflash": d / "dflash", "eagle3": d / "eagle3"}[kind]
    n = 8 if kind == "flashmap" else 6
    proj = read_context_projection(drafter_dir, n)
    p = dict(_proposers(tiny))[kind]()
    x = np.random.default_rng(0).standard_normal((4, p.feature_dim)).astype(np.float32)
    with torch.no_grad():
        own = (p.model.project_context if kind != "eagle3" else p.model.fuse)(torch.from_numpy(x))
    np.testing.assert_allclose(proj(x), own.float().numpy(), rtol=2e-3, atol=2e-3)
    assert proj.width == p.context_dim


def test_in_process_features_stay_on_the_engines_device(tiny):
    """The in-process target hands its features over as tensors (no trip through numpy), and a
    projecting engine hands over D values per position."""
    import asyncio

    target, d = tiny
    engine = TargetEngine(target, n_slots=2, max_seq_len=64)
    slot = engine.allocate()
    row = VerifyRow(slot, 0, np.arange(1, 9), SamplingParams())
    ((res, _),) = asyncio.run(LocalTarget(engine).verify([row]))
    assert isinstance(res.features, torch.Tensor) and res.features.shape == (8, engine.feature_dim)
    proj = read_context_projection(d / "dflash", 6)
    from drafter_service.dflash import load_dflash

    layers = list(load_dflash(d / "dflash", target).cfg.target_layer_ids)
    projecting = TargetEngine(
        target, n_slots=2, max_seq_len=64, feature_layers=layers, context_projection=proj
    )
    s = projecting.allocate()
    (res,) = projecting.verify([VerifyRow(s, 0, np.arange(1, 9), SamplingParams())])
    assert projecting.feature_dim == proj.width and res.features.shape == (8, proj.width)


def test_no_projection_when_it_would_not_change_the_width(tmp_path):
    """A drafter whose context width equals the target's feature width (one feature layer,
    dim = hidden) gets the raw features: projected ones would look raw and be projected again."""
    from drafter_service.checkpoint import init_drafter, save_drafter
    from flashmap.drafter_inputs import target_inputs

    target = make_random_qwen3(tmp_path / "t", num_hidden_layers=4, with_tokenizer=False)
    drafter = init_drafter(target, dim=64, n_blocks=1, n_heads=4, feature_layers=[1])
    save_drafter(drafter, tmp_path / "d")
    layers, proj = target_inputs(tmp_path / "d", target)
    assert layers == [1] and proj is None


def test_a_second_jump_network_adds_no_ops_per_round():
    """Two jumps with the second-jump network (checkpoints/demo-flashmap-eq-2j) dispatch about
    the torch ops of the map's own two jumps (the network's pass replaces the map's), and they
    do not grow with the batch either."""
    torch.set_num_threads(1)
    engine = TargetEngine(DEMO_TARGET, n_slots=8, max_seq_len=256)
    ops = {}
    for name in ("demo-flashmap-eq", "demo-flashmap-eq-2j"):
        for b in (1, 8):
            model = load_model(ROOT / "checkpoints" / name, DEMO_TARGET)
            proposer = make_proposer(  # as trained: the zero state, the network for 2j
                model, n_slots=8, max_context=256, steps=2, **departures_as_trained(model.cfg)
            )
            assert (proposer.second_jump is not None) == name.endswith("2j")
            reqs = [
                GenerationRequest(list(range(5 + i, 29 + i)), 40, request_id=f"r{i}")
                for i in range(b)
            ]
            ops[name, b] = host_work(engine, reqs, proposer, 2, torch.device("cpu"))[
                "ops_per_round"
            ]
    print(f"torch ops per round at 2 jumps: {ops}")
    assert ops["demo-flashmap-eq-2j", 8] <= 1.1 * ops["demo-flashmap-eq-2j", 1], ops
    for b in (1, 8):
        assert ops["demo-flashmap-eq-2j", b] <= 1.05 * ops["demo-flashmap-eq", b], ops
