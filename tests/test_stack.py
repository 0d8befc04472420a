"""Integration tests of the services: a real tritonserver, drafter and orchestrator as
processes on 127.0.0.1 (flashmap_cli.stack.Stack), driven through the client SDK.

Two stacks on a tiny random Qwen3 (fp32 on CPU):
- TestMainStack: the real FlashMap drafter service (untrained "init" drafter), 8 KV slots.
  Greedy exactness against the in-process autoregressive decoder, 16 concurrent streams
  with batched verify forwards, step-count switches in flight and per-request overrides,
  bad requests, cancellation freeing target and drafter slots, the metric catalogue, and
  the drafter killed mid-stream (exact fallback, counted, and used again after a restart).
- TestSmallStack: 2 KV slots, a queue limit of 4, and the drafter service wrapping the
  oracle proposer (the target's own continuation with a seeded 20% error per slot), so
  acceptance is well above zero and varies by slot: queueing and RESOURCE_EXHAUSTED, and
  the speculative counters on /metrics against the per-request SpecStats.

Near-ties: the reference outputs come from the in-process decoder (TargetEngine, one row
per step); transformers' Qwen3 recomputes every reference position with a full forward
and the test asserts its argmax equals the reference and its top-2 logit gap stays above
1e-4, far above fp32 rounding, so a verify over K+1 rows in Triton cannot flip a token.

Run as a script with --oracle-drafter, this file is the oracle drafter process. The services'
logs are in pytest's tmp_path (logs-main, logs-small, the late-drafter test's own).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
VOCAB = 512
BLOCK = 16


# ----------------------------------------------------------------------------- the oracle drafter process


def _oracle_drafter_main(argv: list[str]) -> None:
    """The drafter service (drafter_service.server) around an OracleProposer."""
    import argparse

    from drafter_service.oracle import OracleProposer
    from drafter_service.server import DrafterService, serve
    from flashmap.logs import setup_logging

    ap = argparse.ArgumentParser()
    ap.add_argument("--refs", required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--metrics-port", type=int, required=True)
    ap.add_argument("--error-rate", type=float, default=0.2)
    ap.add_argument("--support", type=int, default=1)
    a = ap.parse_args(argv)
    setup_logging("INFO")
    refs = json.loads(Path(a.refs).read_text())
    proposer = OracleProposer(
        refs,
        block_size=BLOCK,
        vocab_size=a.vocab,
        error_rate=a.error_rate,
        seed=1,
        support=a.support,
    )
    from flashmap.auth import DRAFTER_TOKEN_ENV, read_secret

    asyncio.run(
        serve(
            DrafterService(proposer, name="oracle"),
            "127.0.0.1",
            a.port,
            a.metrics_port,
            token=read_secret(DRAFTER_TOKEN_ENV),
        )
    )


if __name__ == "__main__" and sys.argv[1:2] == ["--oracle-drafter"]:
    _oracle_drafter_main(sys.argv[2:])
    sys.exit(0)


from flashmap.client import (  # noqa: E402 - after the script entry point, which does not need them
    AsyncClient,
    Client,
    DrafterAdmin,
    InvalidArgument,
    ResourceExhausted,
)
from flashmap_cli.stack import Stack, StackConfig  # noqa: E402
from tests.stack_helpers import (  # noqa: E402,F401 - one_thread_per_process is an autouse fixture
    Reference,
    _metrics_text,
    _poll,
    _samples,
    _total,
    one_thread_per_process,
    ref,
    target_dir,
)

# ----------------------------------------------------------------------------- helpers


def _prompts(n: int, seed: int, lo: int = 1, hi: int = 64) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def _by_label(samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in samples:
        if s.name == name:
            out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
    return out


def _stream(client: Client, progress: list | None = None, **kw):
    """Run one streaming request; returns (token ids, final chunk). `progress` (a list)
    receives the tokens as they arrive, for a watcher thread."""
    ids, final = [] if progress is None else progress, None
    for c in client.generate_stream(**kw):
        if c.finished:
            final = c
        else:
            ids.extend(c.token_ids)
    assert final is not None
    return list(ids), final


# ============================================================================= main stack


@pytest.fixture(scope="class")
def stack(target_dir, tmp_path_factory):
    # The whole block every round: these tests check what drafting does (the untrained drafter
    # would make the speculation controller turn drafting off).
    cfg = StackConfig.on_free_ports(
        target_dir=str(target_dir),
        n_slots=8,
        max_seq_len=1024,
        steps=1,
        speculation="full",
        log_dir=str(tmp_path_factory.mktemp("logs-main")),
    )
    with Stack(cfg) as st:
        yield st


@pytest.fixture(scope="class")
def client(stack):
    with Client(stack.cfg.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="class")
def admin(stack):
    a = DrafterAdmin(stack.cfg.drafter_url, token=stack.cfg.drafter_token)
    yield a
    a.close()


def _triton_active(stack) -> float:
    return _total(_samples(stack.cfg.triton_metrics_port), "flashmap_target_active_sequences")


def _all_idle(stack, client, admin):
    """Orchestrator, target and drafter hold no sequence."""
    h = client.health()
    return (
        h.active_requests == 0
        and h.queued_requests == 0
        and _triton_active(stack) == 0
        and admin.stats().active_sequences == 0
    )


def _thread_cpus(pid: int) -> dict[int, tuple[set[int], int]]:
    """Each thread of a process: (the CPUs it may run on, its CPU ticks so far)."""
    from flashmap.measure import thread_ticks

    return {t: (os.sched_getaffinity(t), n) for t, n in thread_ticks(pid).items()}


def _children(pid: int) -> list[int]:
    return [
        int(c)
        for t in Path(f"/proc/{pid}/task").iterdir()
        for c in (t / "children").read_text().split()
    ]


class TestMainStack:
    @pytest.mark.timeout(120)
    def test_target_worker_computes_alone_on_its_cpus_and_the_drafter_may_join(
        self, stack, client, ref
    ):
        if stack.cpus is None:
            pytest.skip("fewer than 2 usable CPUs: the stack does not pin")
        target_cpus, rest = stack.cpus
        server = stack.triton.process.pid
        (stub,) = _children(server)
        before = _thread_cpus(stub)
        prompt = _prompts(1, 11)[0]
        assert (
            list(client.generate(prompt_ids=prompt, max_new_tokens=24, ignore_eos=True).token_ids)
            == ref([prompt], 24)[0]
        )
        after = _thread_cpus(stub)
        busiest = max(after, key=lambda t: after[t][1] - before.get(t, (None, 0))[1])
        assert after[busiest][0] == target_cpus  # the model's compute thread
        assert all(cpus == rest for t, (cpus, _) in after.items() if t != busiest)
        for pid in (server, stack.orch_proc.pid):
            assert {frozenset(c) for c, _ in _thread_cpus(pid).values()} == {frozenset(rest)}, pid
        # The drafter's forward thread alone may also use the target's CPUs (a round drafts while
        # the target idles).
        drafter = sorted(frozenset(c) for c, _ in _thread_cpus(stack.drafter_proc.pid).values())
        assert drafter.count(frozenset(target_cpus | rest)) == 1
        assert set(drafter) == {frozenset(rest), frozenset(target_cpus | rest)}

    @pytest.mark.timeout(120)
    def test_greedy_matches_inprocess_autoregressive(self, stack, client, ref):
        """24 random prompts of 1..64 tokens (plus one of 300), 8 streams at a time: each output
        is token-identical to the in-process autoregressive decoder."""
        prompts = _prompts(23, seed=11) + [_prompts(1, seed=12, lo=300, hi=300)[0]]
        prompts[0] = prompts[0][:1]  # a one-token prompt
        max_new = 32
        expected = ref(prompts, max_new)
        with ThreadPoolExecutor(8) as pool:
            outs = list(
                pool.map(
                    lambda p: _stream(
                        client, prompt_ids=p, max_new_tokens=max_new, ignore_eos=True
                    ),
                    prompts,
                )
            )
        for p, exp, (ids, final) in zip(prompts, expected, outs):
            assert ids == exp
            assert final.finish_reason == "length"
            assert final.completion_tokens == max_new and final.prompt_tokens == len(p)
            assert final.stats.rounds >= 1 and 0 < final.stats.verify_s <= final.total_s
        # The drafter took part (so this is speculative decoding, not only the fallback).
        assert sum(f.stats.drafts for _, f in outs) > 0
        assert sum(f.stats.draft_tokens for _, f in outs) > 0
        assert all(f.stats.draft_s > 0 for _, f in outs if f.stats.drafts)

    @pytest.mark.timeout(120)
    def test_16_concurrent_streams_are_exact_and_batched(self, stack, ref):
        prompts = _prompts(16, seed=21, lo=2, hi=40)
        max_new = 24
        expected = ref(prompts, max_new)
        orch0 = _samples(stack.cfg.metrics_port)
        time.sleep(
            0.5
        )  # the target model sends its metrics between batches, within 0.25 s of a change
        tri0 = _samples(stack.cfg.triton_metrics_port)

        async def run():
            async with AsyncClient(stack.cfg.url, timeout=120) as ac:
                assert (await ac.health()).ready and (
                    await ac.model_info()
                ).max_concurrent == stack.cfg.n_slots

                async def one(p):
                    ids, final = [], None
                    async for c in ac.generate_stream(
                        prompt_ids=p, max_new_tokens=max_new, ignore_eos=True
                    ):
                        if c.finished:
                            final = c
                        else:
                            ids.extend(c.token_ids)
                    return ids, final

                return await asyncio.gather(*(one(p) for p in prompts))

        outs = asyncio.run(run())
        for exp, (ids, final) in zip(expected, outs):
            assert ids == exp
            assert (
                final is not None
                and final.finish_reason == "length"
                and final.completion_tokens == max_new
            )

        orch1 = _samples(stack.cfg.metrics_port)
        time.sleep(0.5)
        tri1 = _samples(stack.cfg.triton_metrics_port)
        d = lambda s0, s1, name, **kw: _total(s1, name, **kw) - _total(s0, name, **kw)  # noqa: E731
        multi = d(orch0, orch1, "flashmap_verify_batch_size_count") - d(
            orch0, orch1, "flashmap_verify_batch_size_bucket", le="1.0"
        )
        assert multi > 0, "no orchestrator round verified more than one sequence"
        rows = d(tri0, tri1, "flashmap_target_verify_rows_total")
        batches = d(tri0, tri1, "flashmap_target_verify_batches_total")
        assert batches > 0 and rows / batches > 1.0, (
            f"Triton ran {batches} forwards for {rows} rows: no batching"
        )

    @pytest.mark.timeout(120)
    def test_step_count_switch_in_flight(self, stack, client, admin, ref):
        """Steps 1 -> 2 -> 1 while 8 requests stream: none fails, all exact, steps-2 blocks were drafted."""
        prompts = _prompts(8, seed=31, lo=3, hi=30)
        max_new = 48
        expected = ref(prompts, max_new)
        d0 = _samples(stack.cfg.drafter_metrics_port)
        progress = [[] for _ in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            futs = [
                pool.submit(
                    _stream,
                    client,
                    progress[i],
                    prompt_ids=p,
                    max_new_tokens=max_new,
                    ignore_eos=True,
                )
                for i, p in enumerate(prompts)
            ]
            _poll("every request to stream a token", lambda: all(len(x) >= 1 for x in progress), 60)
            assert admin.set_steps(2) == 2
            at_switch = sum(map(len, progress))
            in_flight_up = sum(len(x) < max_new for x in progress)
            _poll(
                "16 more tokens at 2 steps",
                lambda: sum(map(len, progress)) >= at_switch + 16 or all(f.done() for f in futs),
                60,
            )
            assert admin.set_steps(1) == 1
            in_flight_down = sum(len(x) < max_new for x in progress)
            outs = [f.result() for f in futs]  # re-raises any failed request
        assert in_flight_up > 0 and in_flight_down > 0, (
            "the switches did not happen while requests were in flight"
        )
        for exp, (ids, final) in zip(expected, outs):
            assert ids == exp and final.finish_reason == "length"
        d1 = _samples(stack.cfg.drafter_metrics_port)
        assert _total(d1, "flashmap_drafter_blocks_total", steps="2") > _total(
            d0, "flashmap_drafter_blocks_total", steps="2"
        )
        assert _total(d1, "flashmap_drafter_blocks_total", steps="1") > _total(
            d0, "flashmap_drafter_blocks_total", steps="1"
        )
        assert admin.get_steps() == 1

    @pytest.mark.timeout(120)
    def test_draft_steps_per_request_and_default(self, stack, client, admin, ref):
        """A per-request draft_steps reaches the drafter (its blocks are drafted with that count, the
        default is untouched); a new default is reported by SpecStats, ModelInfo and /metrics."""
        p = _prompts(1, seed=41, lo=10, hi=10)[0]
        max_new = 24
        (expected,) = ref([p], max_new)
        assert admin.get_steps() == 1
        for steps in (2, 3):
            d0 = _samples(stack.cfg.drafter_metrics_port)
            ids, final = _stream(
                client, prompt_ids=p, max_new_tokens=max_new, ignore_eos=True, draft_steps=steps
            )
            d1 = _samples(stack.cfg.drafter_metrics_port)
            assert ids == expected
            assert final.stats.draft_steps == steps and final.stats.drafts > 0
            blocks = {
                k: _total(d1, "flashmap_drafter_blocks_total", steps=k)
                - _total(d0, "flashmap_drafter_blocks_total", steps=k)
                for k in ("1", "2", "3")
            }
            assert blocks[str(steps)] >= final.stats.drafts > 0, (
                blocks
            )  # >=: a late block is not a draft
            assert sum(blocks.values()) == blocks[str(steps)], (
                blocks
            )  # nothing drafted with the default
        assert admin.get_steps() == 1

        try:
            assert admin.set_steps(2) == 2
            ids, final = _stream(client, prompt_ids=p, max_new_tokens=max_new, ignore_eos=True)
            assert ids == expected
            assert final.stats.draft_steps == 2 and final.stats.drafts > 0
            assert client.model_info().draft_steps == 2
            orch = _samples(stack.cfg.metrics_port)
            assert _total(orch, "flashmap_drafter_steps") == 2
            assert _total(orch, "flashmap_num_drafts_total", steps="2") >= final.stats.drafts
        finally:
            admin.set_steps(1)

    @pytest.mark.timeout(60)
    def test_bad_requests_are_invalid_argument(self, stack, client, ref):
        ok = dict(prompt_ids=[1, 2, 3], max_new_tokens=8, ignore_eos=True)
        cases = [
            ("empty prompt", dict(prompt_ids=[]), "empty"),
            ("prompt longer than the context", dict(prompt_ids=[1] * 1025), "context"),
            (
                "prompt + max_new_tokens past the context",
                dict(prompt_ids=[1] * 1000, max_new_tokens=100),
                "context",
            ),
            ("token id = vocab size", dict(prompt_ids=[1, VOCAB, 2]), "vocabulary"),
            ("negative token id", dict(prompt_ids=[-1, 2]), "vocabulary"),
            ("max_new_tokens 0", dict(max_new_tokens=0), "max_new_tokens"),
            ("temperature < 0", dict(temperature=-0.5), "temperature"),
            ("temperature NaN", dict(temperature=float("nan")), "temperature"),
            ("top_p 0", dict(top_p=0.0), "top_p"),
            ("top_p > 1", dict(top_p=1.5), "top_p"),
            ("draft_steps 0", dict(draft_steps=0), "draft_steps"),
            ("draft_steps 1000", dict(draft_steps=1000), "draft_steps"),
        ]
        for what, kw, word in cases:
            with pytest.raises(InvalidArgument) as e:
                client.generate(**{**ok, **kw})
            assert word in str(e.value), (
                f"{what}: message {str(e.value)!r} does not mention {word!r}"
            )
        # Still serving, exactly.
        assert client.health().ready
        p = _prompts(1, seed=51)[0]
        (expected,) = ref([p], 16)
        assert (
            client.generate(prompt_ids=p, max_new_tokens=16, ignore_eos=True).token_ids == expected
        )

    @pytest.mark.timeout(90)
    def test_limits_at_the_public_apis(self, stack, client):
        """gRPC Generate and the OpenAI API refuse what every entry point refuses, with the
        same message (the cases and the other entry points: tests/test_limits.py)."""
        import httpx

        from tests.test_limits import DRAFT_STEPS_CASES, MAX_DRAFT_TOKENS_CASES

        ok = dict(prompt_ids=[1, 2, 3], max_new_tokens=4, ignore_eos=True)
        body = dict(model=client.model_info().model, prompt="hello", max_tokens=4)
        for name, cases in (
            ("draft_steps", DRAFT_STEPS_CASES),
            ("max_draft_tokens", MAX_DRAFT_TOKENS_CASES),
        ):
            for value, message in cases:
                r = httpx.post(
                    f"{stack.cfg.http_url}/completions", json={**body, name: value}, timeout=60
                )
                if message is None:
                    assert r.status_code == 200, r.text
                    assert len(client.generate(**ok, **{name: value}).token_ids) == 4
                    continue
                assert r.status_code == 400 and r.json()["error"]["message"] == message
                if value >= 0:  # the gRPC field is unsigned: a negative cannot be sent
                    with pytest.raises(InvalidArgument) as e:
                        client.generate(**ok, **{name: value})
                    assert str(e.value).endswith(message), e.value

    @pytest.mark.timeout(90)
    def test_cancel_frees_target_and_drafter_slots(self, stack, client, admin, ref):
        p = _prompts(1, seed=61, lo=5, hi=5)[0]
        max_new = 400
        (expected,) = ref([p], max_new)
        aborts0 = _total(
            _samples(stack.cfg.metrics_port), "flashmap_requests_total", status="abort"
        )

        # 1. The caller stops iterating: the generator is closed, the call cancelled.
        got = []
        for c in client.generate_stream(prompt_ids=p, max_new_tokens=max_new, ignore_eos=True):
            got.extend(c.token_ids)
            if len(got) >= 3:
                # While it streams, target and drafter hold the sequence.
                _poll("the target to hold the sequence", lambda: _triton_active(stack) >= 1, 10)
                _poll(
                    "the drafter to hold the sequence",
                    lambda: admin.stats().active_sequences >= 1,
                    10,
                )
                break
        assert got == expected[: len(got)]
        _poll(
            "target, drafter and orchestrator to be idle after a cancelled stream",
            lambda: _all_idle(stack, client, admin),
            20,
        )

        # 2. Client.abort(request_id) from another thread.
        progress: list[int] = []
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(
                _stream,
                client,
                progress,
                prompt_ids=p,
                max_new_tokens=max_new,
                ignore_eos=True,
                request_id="cancel-me",
            )
            _poll("the request to stream", lambda: len(progress) >= 3 or fut.done(), 30)
            _poll(
                "the drafter to hold the sequence",
                lambda: admin.stats().active_sequences >= 1 or fut.done(),
                10,
            )
            assert client.abort("cancel-me") is True
            ids, final = fut.result(timeout=30)
        assert final.finish_reason == "abort"
        assert 3 <= len(ids) < max_new and ids == expected[: len(ids)]
        assert client.abort("cancel-me") is False  # gone
        _poll(
            "target, drafter and orchestrator to be idle after Abort",
            lambda: _all_idle(stack, client, admin),
            20,
        )
        aborts1 = _total(
            _samples(stack.cfg.metrics_port), "flashmap_requests_total", status="abort"
        )
        assert aborts1 - aborts0 == 2

    @pytest.mark.timeout(60)
    def test_metric_catalogue(self, stack, client):
        """Every metric of docs/ARCHITECTURE.md has a sample line on the orchestrator's /metrics (before any
        fallback happened: counters with known labels are exported at zero)."""
        client.generate(prompt_ids=[5, 6, 7], max_new_tokens=8, ignore_eos=True)
        text = _metrics_text(stack.cfg.metrics_port)
        names = [
            "flashmap_num_drafts_total",
            "flashmap_num_draft_tokens_total",
            "flashmap_num_accepted_tokens_total",
            "flashmap_num_accepted_tokens_per_pos_total",
            "flashmap_acceptance_length_bucket",
            "flashmap_draft_latency_seconds_bucket",
            "flashmap_verify_latency_seconds_bucket",
            "flashmap_round_latency_seconds_bucket",
            "flashmap_time_to_first_token_seconds_bucket",
            "flashmap_inter_token_latency_seconds_bucket",
            "flashmap_requests_total",
            "flashmap_active_requests",
            "flashmap_drafter_steps",
            "flashmap_fallback_rounds_total",
        ]
        missing = [n for n in names if not re.search(rf"^{n}[{{ ]", text, re.M)]
        assert not missing, f"no sample of {missing}"
        # Latency buckets start at 100 microseconds; labels model / drafter / steps.
        assert re.search(r'^flashmap_round_latency_seconds_bucket\{.*le="0\.0001".*\}', text, re.M)
        assert re.search(
            r'^flashmap_num_drafts_total\{(?=.*model=")(?=.*drafter=")(?=.*steps=").*\}', text, re.M
        )
        assert re.search(r'^flashmap_requests_total\{.*status="length".*\} [1-9]', text, re.M)

    @pytest.mark.timeout(60)
    def test_rounds_without_drafts_decode_several_tokens_per_call(self, stack, client, ref):
        """Speculation off for a request: after its prompt's round, each round decodes
        --plain-tokens tokens in one call to Triton; the text is the target's."""
        steps = stack.cfg.plain_tokens
        p = _prompts(1, seed=81, lo=5, hi=5)[0]
        (exp,) = ref([p], 1 + 2 * steps)
        orch0, tri0 = _samples(stack.cfg.metrics_port), _samples(stack.cfg.triton_metrics_port)
        ids, final = _stream(
            client, prompt_ids=p, max_new_tokens=1 + 2 * steps, ignore_eos=True, max_draft_tokens=0
        )
        assert ids == exp and final.stats.rounds == 2 * steps and final.stats.drafts == 0
        orch1, tri1 = _samples(stack.cfg.metrics_port), _samples(stack.cfg.triton_metrics_port)
        d = lambda a, b, name: _total(b, name) - _total(a, name)  # noqa: E731
        assert d(orch0, orch1, "flashmap_plain_tokens_count") == 2
        assert d(orch0, orch1, "flashmap_plain_tokens_sum") == 2 * steps
        assert (
            d(tri0, tri1, "nv_inference_exec_count") <= 4
        )  # prompt, 2 calls of `steps` tokens, the release

    @pytest.mark.timeout(150)
    def test_drafter_killed_mid_stream_then_restarted(self, stack, client, admin, ref):
        prompts = _prompts(4, seed=71, lo=3, hi=20)
        max_new = 64
        expected = ref(prompts, max_new)
        fb0 = _total(_samples(stack.cfg.metrics_port), "flashmap_fallback_rounds_total")
        progress = [[] for _ in prompts]
        try:
            with ThreadPoolExecutor(len(prompts)) as pool:
                futs = [
                    pool.submit(
                        _stream,
                        client,
                        progress[i],
                        prompt_ids=p,
                        max_new_tokens=max_new,
                        ignore_eos=True,
                    )
                    for i, p in enumerate(prompts)
                ]
                _poll(
                    "every request to stream 4 tokens",
                    lambda: all(len(x) >= 4 for x in progress),
                    60,
                )
                stack.drafter_proc.kill()
                stack.drafter_proc.wait(10)
                in_flight = sum(len(x) < max_new for x in progress)
                outs = [f.result() for f in futs]
            assert in_flight > 0, "the drafter died after the requests had finished"
            for exp, (ids, final) in zip(expected, outs):
                assert ids == exp and final.finish_reason == "length"
            assert sum(f.stats.fallback_rounds for _, f in outs) > 0
            fb1 = _total(_samples(stack.cfg.metrics_port), "flashmap_fallback_rounds_total")
            assert fb1 > fb0, "fallback rounds were not counted"
            assert client.health().drafter_ready is False
        finally:
            if stack.drafter_proc is None or stack.drafter_proc.poll() is not None:
                stack.start_drafter()  # waits for its health check

        # The orchestrator reconnects (at most once a second) and drafts again.
        p = _prompts(1, seed=72, lo=6, hi=6)[0]
        (exp,) = ref([p], 32)
        ids, final = _stream(client, prompt_ids=p, max_new_tokens=32, ignore_eos=True)
        assert ids == exp
        assert final.stats.drafts > 0, "the restarted drafter was not used"
        assert client.health().drafter_ready
        _poll(
            "the restarted drafter to drop the finished sequence",
            lambda: admin.stats().active_sequences == 0,
            10,
        )


# ============================================================================= late drafter


@pytest.mark.timeout(150)
def test_late_drafter_falls_back_exactly_and_is_released(target_dir, ref, tmp_path):
    """A drafter slower than the orchestrator's draft timeout: (nearly) every round falls back (exact,
    counted with reason "timeout"), and the drafter still gets every sequence released."""
    prompts = _prompts(3, seed=101, lo=3, hi=12)
    max_new = 16
    expected = ref(prompts, max_new)
    # speculation="full": every round wants a draft (the controller would soon stop asking a drafter
    # that never answers in time, and then no round would fall back).
    cfg = StackConfig.on_free_ports(
        target_dir=str(target_dir),
        n_slots=4,
        max_seq_len=1024,
        draft_timeout_s=1e-4,
        speculation="full",
        log_dir=str(tmp_path),
    )
    with Stack(cfg) as st, Client(cfg.url, timeout=120) as c:
        admin = DrafterAdmin(cfg.drafter_url, token=cfg.drafter_token)
        try:
            with ThreadPoolExecutor(len(prompts)) as pool:
                outs = list(
                    pool.map(
                        lambda p: _stream(c, prompt_ids=p, max_new_tokens=max_new, ignore_eos=True),
                        prompts,
                    )
                )
            for exp, (ids, final) in zip(expected, outs):
                assert ids == exp and final.finish_reason == "length"
                # The timeout counts from when the request is written: an answer that came in
                # while a loaded machine was still finishing the write is used (in CI, as many
                # as one round in two), so this asserts that every request fell back, not how often.
                assert final.stats.fallback_rounds > 0
            m = _samples(cfg.metrics_port)
            assert _total(m, "flashmap_fallback_rounds_total", reason="timeout") > 0
            # The drafter does the (late) work: it takes context for these sequences...
            _poll(
                "the drafter to answer a late call",
                lambda: (
                    _total(_samples(cfg.drafter_metrics_port), "flashmap_drafter_blocks_total") > 0
                ),
                20,
            )
            # ...and must not keep it until its idle timeout (300 s) once they are finished.
            _poll(
                "the drafter to drop the finished sequences",
                lambda: admin.stats().active_sequences == 0,
                10,
            )
            _poll("the target to drop the finished sequences", lambda: _triton_active(st) == 0, 10)
        finally:
            admin.close()


@pytest.mark.timeout(240)
def test_shadow_probes_through_the_stack_are_exact_and_released(target_dir, ref, tmp_path):
    """The speculation controller with the untrained drafter (it turns drafting off) and the
    pipeline on: greedy requests are probed beside the rounds sent ahead (their rows fetch the
    features the drafter lacks, the drafter drafts while the target decodes); every output equals
    the target alone's, the probes are counted, and the drafter holds nothing afterwards."""
    prompts = _prompts(
        64, seed=111, lo=3, hi=20
    )  # enough rounds for several probes (their interval doubles)
    max_new = 64
    expected = ref(prompts, max_new)
    cfg = StackConfig.on_free_ports(
        target_dir=str(target_dir), n_slots=4, max_seq_len=1024, log_dir=str(tmp_path)
    )
    assert cfg.speculation == "auto" and cfg.pipeline and cfg.plain_tokens > 1
    with Stack(cfg) as st, Client(cfg.url, timeout=120) as c:
        admin = DrafterAdmin(cfg.drafter_url, token=cfg.drafter_token)
        try:
            with ThreadPoolExecutor(4) as pool:
                outs = list(
                    pool.map(
                        lambda p: _stream(c, prompt_ids=p, max_new_tokens=max_new, ignore_eos=True),
                        prompts,
                    )
                )
            for exp, (ids, final) in zip(expected, outs):
                assert ids == exp and final.finish_reason == "length"
            m = _samples(cfg.metrics_port)
            assert _total(m, "flashmap_shadow_probes_total") > 0
            assert (
                _total(m, "flashmap_controller_accepted_tokens_total", kind="expected") > 0
            )  # the first probe's
            assert (
                _total(m, "flashmap_speculation_off_rounds_total") > 0
                and _total(m, "flashmap_rounds_ahead_total") > 0
            )
            _poll(
                "the drafter to drop the finished sequences",
                lambda: admin.stats().active_sequences == 0,
                10,
            )
            _poll("the target to drop the finished sequences", lambda: _triton_active(st) == 0, 10)
        finally:
            admin.close()


# ============================================================================= small stack


class OracleStack(Stack):
    """A Stack whose drafter process is the drafter service around the oracle proposer."""

    def __init__(self, cfg: StackConfig, refs_path: Path, support: int = 1):
        super().__init__(cfg)
        self.refs_path, self.support = refs_path, support

    def start_drafter(self, wait: bool = True) -> None:
        c = self.cfg
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
        with open(self._log("drafter"), "ab") as f:
            self.drafter_proc = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--oracle-drafter",
                    "--refs",
                    str(self.refs_path),
                    "--vocab",
                    str(VOCAB),
                    "--port",
                    str(c.drafter_port),
                    "--metrics-port",
                    str(c.drafter_metrics_port),
                    "--support",
                    str(self.support),
                ],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(REPO_ROOT),
                start_new_session=True,
            )
        if wait:
            self.wait_drafter()


ORACLE_PROMPTS = _prompts(6, seed=81, lo=4, hi=24)
ORACLE_MAX_NEW = 40


@pytest.fixture(scope="class")
def small_stack(target_dir, ref, tmp_path_factory):
    refs = [p + out for p, out in zip(ORACLE_PROMPTS, ref(ORACLE_PROMPTS, ORACLE_MAX_NEW))]
    refs_path = tmp_path_factory.mktemp("oracle") / "refs.json"
    refs_path.write_text(json.dumps(refs))
    # speculation="full": the counters are checked on drafted rounds (the earlier tests' prompts,
    # which the oracle does not know, teach the speculation controller to stop drafting).
    cfg = StackConfig.on_free_ports(
        target_dir=str(target_dir),
        drafter="oracle",
        n_slots=2,
        max_queue=4,
        max_seq_len=1024,
        speculation="full",
        log_dir=str(tmp_path_factory.mktemp("logs-small")),
    )
    with OracleStack(cfg, refs_path) as st:
        yield st


@pytest.fixture(scope="class")
def small_client(small_stack):
    with Client(small_stack.cfg.url, timeout=120) as c:
        yield c


class TestSmallStack:
    @pytest.mark.timeout(120)
    def test_queue_beyond_slots_then_resource_exhausted(self, small_stack, small_client, ref):
        """2 KV slots, queue limit 4: 6 concurrent requests wait and all succeed exactly; a 7th while
        the queue is full gets RESOURCE_EXHAUSTED; the server keeps serving."""
        c = small_client
        info = c.model_info()
        assert info.max_concurrent == 2 and info.max_queue == 4
        prompts = _prompts(6, seed=91, lo=3, hi=12)
        max_new = 64
        expected = ref(prompts, max_new)
        with ThreadPoolExecutor(6) as pool:
            futs = [
                pool.submit(_stream, c, None, prompt_ids=p, max_new_tokens=max_new, ignore_eos=True)
                for p in prompts
            ]
            _poll(
                "2 active and 4 queued requests",
                lambda: (lambda h: h.active_requests == 2 and h.queued_requests == 4)(c.health()),
                30,
                0.01,
            )
            with pytest.raises(ResourceExhausted) as e:
                c.generate(prompt_ids=[1, 2, 3], max_new_tokens=4)
            assert "queue" in str(e.value)
            outs = [f.result() for f in futs]
        for exp, (ids, final) in zip(expected, outs):
            assert ids == exp and final.finish_reason == "length"
        (exp,) = ref([[1, 2, 3]], 8)
        assert c.generate(prompt_ids=[1, 2, 3], max_new_tokens=8, ignore_eos=True).token_ids == exp

    @pytest.mark.timeout(120)
    def test_speculative_counters_match_request_stats(self, small_stack, small_client, ref):
        """With the oracle drafter (acceptance well above 0): the /metrics deltas over these requests
        equal the sums of their SpecStats, slot by slot, and mean gamma = 1 + accepted / drafts."""
        c = small_client
        expected = ref(ORACLE_PROMPTS, ORACLE_MAX_NEW)
        _poll(
            "an idle server",
            lambda: c.health().active_requests == 0 and c.health().queued_requests == 0,
            30,
        )
        m0 = _samples(small_stack.cfg.metrics_port)
        with ThreadPoolExecutor(len(ORACLE_PROMPTS)) as pool:
            # Seeded: the draft seeds, hence the oracle's injected errors, are reproducible.
            outs = list(
                pool.map(
                    lambda i: _stream(
                        c,
                        prompt_ids=ORACLE_PROMPTS[i],
                        max_new_tokens=ORACLE_MAX_NEW,
                        ignore_eos=True,
                        seed=i,
                    ),
                    range(len(ORACLE_PROMPTS)),
                )
            )
        m1 = _samples(small_stack.cfg.metrics_port)
        for exp, (ids, final) in zip(expected, outs):
            assert ids == exp and final.finish_reason == "length"
        stats = [f.stats for _, f in outs]
        drafts = sum(s.drafts for s in stats)
        draft_tokens = sum(s.draft_tokens for s in stats)
        accepted = sum(s.accepted for s in stats)
        per_slot = np.sum([s.accepted_per_slot for s in stats], axis=0)
        # Meaningful: drafts happened, many were accepted, and not all of them.
        assert drafts > 0 and 0 < accepted < draft_tokens
        assert per_slot[0] > per_slot[-1] >= 0 and per_slot[1] > 0

        d = lambda name, **kw: _total(m1, name, **kw) - _total(m0, name, **kw)  # noqa: E731
        assert d("flashmap_num_drafts_total") == drafts
        assert d("flashmap_num_draft_tokens_total") == draft_tokens
        assert d("flashmap_num_accepted_tokens_total") == accepted
        pos0 = _by_label(m0, "flashmap_num_accepted_tokens_per_pos_total", "position")
        pos1 = _by_label(m1, "flashmap_num_accepted_tokens_per_pos_total", "position")
        for k in range(BLOCK):
            key = str(k + 1)
            assert pos1.get(key, 0.0) - pos0.get(key, 0.0) == per_slot[k], f"position {key}"
        assert d("flashmap_acceptance_length_count") == drafts
        assert d("flashmap_acceptance_length_sum") == drafts + accepted
        gamma_metrics = 1.0 + d("flashmap_num_accepted_tokens_total") / d(
            "flashmap_num_drafts_total"
        )
        gamma_requests = 1.0 + accepted / drafts
        assert gamma_metrics == pytest.approx(gamma_requests, abs=1e-12)
        assert gamma_metrics > 1.5
        # Each request's own mean acceptance length is consistent with its counts.
        for s in stats:
            assert s.mean_acceptance_length == pytest.approx(1.0 + s.accepted / s.drafts)


# ============================================================================= tree verification


def _oracle_world(target_dir, ref, tmp_path, prompts, **options):
    """The target alone's answers, the oracle's references (and their file) and a stack config
    that serves the oracle drafting the whole block every round."""
    expected = ref(prompts, ORACLE_MAX_NEW)
    refs = [p + out for p, out in zip(prompts, expected)]
    refs_path = tmp_path / "refs.json"
    refs_path.write_text(json.dumps(refs))
    cfg = StackConfig.on_free_ports(
        target_dir=str(target_dir),
        drafter="oracle",
        n_slots=4,
        max_seq_len=1024,
        speculation="full",
        log_dir=str(tmp_path / "logs"),
        **options,
    )
    return expected, refs, refs_path, cfg


@pytest.mark.timeout(240)
def test_tree_verification_through_the_stack_is_the_in_process_round(target_dir, ref, tmp_path):
    """tree_blocks = 3 through Triton, the drafter service and the orchestrator: T = 0 output equal
    to the target alone, and round for round what the in-process decoder does with the same
    oracle and seeds (both runtimes call flashmap.rounds.speculative_round); the tree accepts
    more than one block per round would."""
    from drafter_service.oracle import OracleProposer
    from flashmap.inprocess import decode
    from flashmap.types import GenerationRequest, SamplingParams

    prompts, max_new = ORACLE_PROMPTS[:3], ORACLE_MAX_NEW
    expected, refs, refs_path, cfg = _oracle_world(
        target_dir, ref, tmp_path, prompts, tree_blocks=3
    )
    with OracleStack(cfg, refs_path), Client(cfg.url, timeout=120) as c:
        outs = [
            _stream(c, prompt_ids=p, max_new_tokens=max_new, ignore_eos=True, seed=i)
            for i, p in enumerate(prompts)
        ]
    for exp, (ids, final) in zip(expected, outs):
        assert ids == exp and final.finish_reason == "length"

    def local(tree_blocks: int):
        reqs = [
            GenerationRequest(p, max_new, SamplingParams(seed=i)) for i, p in enumerate(prompts)
        ]
        return decode(
            ref.engine,
            reqs,
            OracleProposer(refs, BLOCK, VOCAB, error_rate=0.2, seed=1),
            tree_blocks=tree_blocks,
        )

    tree = local(3)
    for mine, (_, final) in zip(tree, outs):
        s = final.stats
        assert (s.rounds, s.drafts, s.draft_tokens, s.accepted) == (
            mine.stats.rounds,
            mine.stats.drafts,
            mine.stats.draft_tokens,
            mine.stats.accepted,
        )
        assert s.accepted_per_slot.tolist() == mine.stats.accepted_per_slot.tolist()
    assert sum(r.stats.accepted for r in tree) > sum(r.stats.accepted for r in local(1))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tree_sampling", ["pick", "siblings"])
def test_sampled_trees_through_the_stack_are_the_in_process_rounds(
    target_dir, ref, tmp_path, tree_sampling
):
    """tree_blocks = 3 as a request option at T = 1 (and top-k / top-p): through Triton, the
    drafter service and the orchestrator, seeded requests give the tokens the in-process decoder
    gives with the same oracle and seeds (whose law tests/test_lossless.py checks), twice; the
    trees followed by the target's picks, or walked by multi-draft rejection sampling with the
    drafts' proposal law on the wire ("siblings": each drafted token with 2 leaves beside it)."""
    from drafter_service.oracle import OracleProposer
    from flashmap.inprocess import decode
    from flashmap.types import GenerationRequest, SamplingParams

    prompts, max_new = ORACLE_PROMPTS[:3], ORACLE_MAX_NEW
    support = 3 if tree_sampling == "siblings" else 1
    expected, refs, refs_path, cfg = _oracle_world(
        target_dir, ref, tmp_path, prompts, tree_sampling=tree_sampling, top_m=support
    )
    params = [SamplingParams(1.0, seed=10 + i) for i in range(len(prompts))]
    params[-1] = SamplingParams(0.8, top_k=20, top_p=0.9, seed=30)
    sampling = lambda p: dict(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed)  # noqa: E731
    with OracleStack(cfg, refs_path, support), Client(cfg.url, timeout=120) as c:
        m0 = _samples(cfg.metrics_port)
        runs = [
            [
                _stream(
                    c,
                    prompt_ids=pr,
                    max_new_tokens=max_new,
                    ignore_eos=True,
                    tree_blocks=3,
                    **sampling(p),
                )
                for pr, p in zip(prompts, params)
            ]
            for _ in range(2)
        ]
        m1 = _samples(cfg.metrics_port)
    # Tree rounds count as chains do: a draft per round, its nodes drafted, its path accepted.
    stats = [f.stats for run in runs for _, f in run]
    d = lambda name: _total(m1, name) - _total(m0, name)  # noqa: E731
    assert d("flashmap_num_drafts_total") == sum(s.drafts for s in stats)
    assert d("flashmap_num_draft_tokens_total") == sum(s.draft_tokens for s in stats)
    assert d("flashmap_num_accepted_tokens_total") == sum(s.accepted for s in stats)
    reqs = [GenerationRequest(pr, max_new, p, tree_blocks=3) for pr, p in zip(prompts, params)]
    local = decode(
        ref.engine,
        reqs,
        OracleProposer(refs, BLOCK, VOCAB, error_rate=0.2, seed=1, support=support),
        tree_sampling=tree_sampling,
        top_m=support,
    )
    for run in runs:
        assert [ids for ids, _ in run] == [r.token_ids for r in local]
    for mine, (_, final) in zip(local, runs[0]):
        assert final.stats.drafts == mine.stats.drafts > 0
        assert final.stats.accepted == mine.stats.accepted
        assert final.stats.draft_tokens == mine.stats.draft_tokens
        # three chains of at most BLOCK tokens, and with siblings 2 leaves beside each token
        assert (mine.stats.draft_tokens > 3 * BLOCK * mine.stats.drafts) == (support > 1)
