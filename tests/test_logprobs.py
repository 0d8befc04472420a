"""Log-probabilities of the generated tokens come from the target's verify pass, so they are the
target's own whatever the drafter proposes: for every way a round commits a token (an accepted
draft, the target's token after a rejection, the bonus token, a residual drawn from the draft's
support, a tree's accepted path, a multi-step row) the log-probability and the top tokens equal
what transformers' Qwen3 gives for the same text, at T = 0 and at T > 0 with a seed.

The reference is teacher-forced: one transformers forward over prompt + generated tokens, its
log-softmax (the raw distribution, before temperature, top-k and top-p) at each generated
position. fp32 on CPU: equal to 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drafter_service.factory import load_proposer
from drafter_service.oracle import OracleProposer
from flashmap.inprocess import decode
from flashmap.types import GenerationRequest, InvalidRequest, SamplingParams
from target_service.engine import TargetEngine
from target_service.random_checkpoint import make_random_qwen3
from tests.drafter_helpers import TreeProposer

TOP, MAX_NEW, N_PROMPTS = 4, 24, 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from transformers import Qwen3ForCausalLM

    path = make_random_qwen3(tmp_path_factory.mktemp("logprobs"), with_tokenizer=False, seed=11)
    engine = TargetEngine(path, n_slots=N_PROMPTS)
    hf = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(0, 512, size=int(rng.integers(3, 12))).tolist() for _ in range(N_PROMPTS)
    ]
    greedy = decode(engine, [GenerationRequest(p, MAX_NEW) for p in prompts])
    references = [p + r.token_ids for p, r in zip(prompts, greedy)]
    return path, engine, hf, prompts, references


def _teacher_forced(hf, prompt: list[int], out: list[int]) -> torch.Tensor:
    """[len(out), V] transformers' log-softmax at each generated position."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + out]), use_cache=False).logits[0].float()
    return logits.log_softmax(-1)[len(prompt) - 1 : len(prompt) + len(out) - 1]


def _assert_target_logprobs(hf, prompts, results):
    for prompt, r in zip(prompts, results):
        assert len(r.logprobs) == len(r.token_ids) > 0
        assert [x.token for x in r.logprobs] == r.token_ids
        ref = _teacher_forced(hf, prompt, r.token_ids)
        want = ref.gather(1, torch.tensor(r.token_ids)[:, None])[:, 0].numpy()
        got = np.array([x.logprob for x in r.logprobs])
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        top_lp, top_ids = ref.topk(TOP + 1, dim=-1)
        for j, x in enumerate(r.logprobs):
            np.testing.assert_allclose(x.top_logprobs, top_lp[j, :TOP].numpy(), atol=1e-4, rtol=0)
            gaps = -np.diff(top_lp[j].numpy())
            if gaps.min() > 1e-4:  # no near-tie that rounding could reorder
                assert x.top_ids == top_ids[j, :TOP].tolist()


def _requests(prompts, params, seed_base=0):
    return [
        GenerationRequest(
            p,
            MAX_NEW,
            params
            if params.greedy
            else SamplingParams(**{**params.__dict__, "seed": seed_base + i}),
            logprobs=TOP,
        )
        for i, p in enumerate(prompts)
    ]


PARAMS = [SamplingParams(), SamplingParams(0.5), SamplingParams(1.0, top_k=20, top_p=0.9)]


@pytest.mark.parametrize("params", PARAMS, ids=["T0", "T0.5", "T1-k20-p0.9"])
def test_logprobs_are_the_targets_whatever_commits_the_token(target, params):
    path, engine, hf, prompts, refs = target
    alone = decode(engine, _requests(prompts, params))
    _assert_target_logprobs(hf, prompts, alone)
    drafters = {
        # Accepted drafts, the target's token at a rejection, and full blocks with the bonus.
        "oracle": (OracleProposer(refs, 16, 512, error_rate=0.2, seed=1), {}),
        # Sparse supports at T > 0: a residual may come from the draft's support.
        "flashmap": (load_proposer("init", str(path), n_slots=N_PROMPTS, max_context=512), {}),
        # Trees: the accepted path's tokens.
        "tree": (TreeProposer([-1, 0, 0, 1, -1], 512), {}),
        "oracle-tree": (OracleProposer(refs, 16, 512, error_rate=0.2, seed=1), {"tree_blocks": 3}),
    }
    accepted = 0
    for name, (proposer, kw) in drafters.items():
        out = decode(engine, _requests(prompts, params), proposer, **kw)
        _assert_target_logprobs(hf, prompts, out)
        if params.greedy:  # speculation does not change the text, nor its log-probabilities
            assert [r.token_ids for r in out] == [r.token_ids for r in alone], name
            for a, b in zip(alone, out):
                np.testing.assert_allclose(
                    [x.logprob for x in a.logprobs], [x.logprob for x in b.logprobs], atol=1e-4
                )
        accepted += sum(r.stats.accepted for r in out)
    assert accepted > 0, "no draft was accepted: the test would not exercise accepted drafts"
    # Several tokens per call (rows without drafts decoding plain_tokens steps).
    multi = decode(engine, _requests(prompts, params), plain_tokens=4)
    _assert_target_logprobs(hf, prompts, multi)
    if not params.greedy:  # the same seeds: the same text as one token per call
        assert [r.token_ids for r in multi] == [r.token_ids for r in alone]


def test_requests_without_logprobs_get_none_and_limits_are_checked(target):
    _, engine, _, prompts, _ = target
    (plain,) = decode(engine, [GenerationRequest(prompts[0], 4)])
    assert plain.logprobs is None
    (zero,) = decode(engine, [GenerationRequest(prompts[0], 4, logprobs=0)])
    assert len(zero.logprobs) == 4 and all(x.top_ids == [] for x in zero.logprobs)
    with pytest.raises(InvalidRequest, match="top_logprobs must be in 0..20"):
        GenerationRequest(prompts[0], 4, logprobs=21).validate(512, 512)
