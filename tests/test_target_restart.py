"""Requests survive a killed tritonserver, against the real processes on 127.0.0.1.

One stack (a tiny random Qwen3, the untrained FlashMap drafter, speculation "full") and, over
the same Triton, a second orchestrator without a drafter (rounds without drafts, each sent
before the one it follows has answered: flashmap.pipeline) and a third whose resume timeout is
half a second. While 12 greedy streams (half through the OpenAI API) and a seeded sampled one
run on the first, and 4 greedy and a seeded one on the second, tritonserver is killed with
SIGKILL and the supervisor of `flashmap up` (flashmap_cli.stack.Supervisor) restarts it. Every
stream ends with exactly the tokens of a run without the kill (greedy: the target alone in
process, checked for near-ties; seeded: the same requests on the same orchestrators before the
kill), and none errs; a request whose deadline passes during the outage ends DEADLINE_EXCEEDED,
the one on the third orchestrator UNAVAILABLE saying the target was down;
flashmap_resumed_requests_total counts the requests that continued. orchestrator.resume is the
mechanism; tests/test_resume.py checks the same in one process.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

from flashmap.client import Client, FlashMapError
from flashmap_cli.stack import Stack, StackConfig, Supervisor
from tests.stack_helpers import (  # noqa: F401 - target_dir, ref, one_thread_per_process: fixtures
    _poll,
    _samples,
    _total,
    one_thread_per_process,
    ref,
    target_dir,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

VOCAB = 512
MAX_NEW = 96
RESUMED = "flashmap_resumed_requests_total"


@pytest.fixture(scope="module")
def stack(target_dir, tmp_path_factory):
    cfg = StackConfig.on_free_ports(
        target_dir=str(target_dir),
        n_slots=24,
        max_seq_len=1024,
        speculation="full",
        log_dir=str(tmp_path_factory.mktemp("logs-restart")),
    )
    with Stack(cfg) as st:
        yield st


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, int(rng.integers(3, 30))).tolist() for _ in range(n)]


def _grpc(url: str, got: list, timeout: float | None = 300, **kw):
    """One Generate stream, its tokens into `got` as they come: ("ok", final chunk) or
    (status code name, FlashMapError)."""
    with Client(url, timeout=timeout) as c:
        try:
            for chunk in c.generate_stream(ignore_eos=True, **kw):
                if chunk.finished:
                    return "ok", chunk
                got.extend(chunk.token_ids)
        except FlashMapError as e:
            return e.code.name, e
    return "no final chunk", None


def _openai(base_url: str, got: list, prompt: list[int], max_tokens: int):
    """One streamed /v1/completions (greedy, token ids back): ("ok", finish reason) or the error."""
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as c:
        model = c.models.list().data[0].id
        finish = None
        try:
            extra = {"ignore_eos": True, "return_token_ids": True}
            for ch in c.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body=extra,
            ):
                for cc in ch.choices:
                    got.extend(cc.token_ids or [])
                    finish = cc.finish_reason or finish
        except openai.APIError as e:
            return type(e).__name__, e
    return "ok", finish


def _resumed(port: int) -> float:
    return _total(_samples(port), RESUMED)


def test_streams_continue_exactly_on_a_restarted_tritonserver(stack, ref):
    # Two tokens per call: the rounds sent ahead last long enough to be cut by the kill.
    plain_proc, plain = stack.extra_orchestrator("plain", with_drafter=False, plain_tokens=2)
    short_proc, short = stack.extra_orchestrator("short", with_drafter=False, resume_timeout_s=0.5)
    main_url, plain_url = stack.cfg.url, plain.url
    greedy = _prompts(16, seed=63)
    want = ref(greedy, MAX_NEW)
    seeded = dict(prompt_ids=[7, 8, 9, 10], max_new_tokens=MAX_NEW, temperature=1.0, seed=5)
    seeded_want = {"main": [], "plain": []}
    with ThreadPoolExecutor(2) as pool:  # the seeded requests' text without a kill
        for name, url in (("main", main_url), ("plain", plain_url)):
            pool.submit(_grpc, url, seeded_want[name], **seeded)
    assert all(len(v) == MAX_NEW for v in seeded_want.values())
    resumed0 = _resumed(stack.cfg.metrics_port), _resumed(plain.metrics_port)

    # name -> (function, progress, its arguments)
    streams: dict[str, tuple] = {}
    for i, p in enumerate(greedy[:12]):
        if i % 2:
            streams[f"openai-{i}"] = (_openai, stack.cfg.http_url, p, MAX_NEW)
        else:
            streams[f"grpc-{i}"] = (_grpc, main_url, dict(prompt_ids=p, max_new_tokens=MAX_NEW))
    for i, p in enumerate(greedy[12:], 12):
        streams[f"plain-{i}"] = (_grpc, plain_url, dict(prompt_ids=p, max_new_tokens=MAX_NEW))
    streams["seeded-main"] = (_grpc, main_url, seeded)
    streams["seeded-plain"] = (_grpc, plain_url, seeded)
    progress = {name: [] for name in streams}
    late = dict(prompt_ids=[11, 12, 13], max_new_tokens=900)
    extra = {"deadline": [], "short": []}

    stop = threading.Event()
    sup = Supervisor(stack, probe_interval_s=1.0, log=lambda m: None)
    supervisor = threading.Thread(target=sup.run, args=(stop, 0.25), daemon=True)
    supervisor.start()
    try:
        with ThreadPoolExecutor(len(streams) + 2) as pool:
            futs = {}
            for name, (fn, where, *args) in streams.items():
                if fn is _grpc:
                    futs[name] = pool.submit(fn, where, progress[name], **args[0])
                else:
                    futs[name] = pool.submit(fn, where, progress[name], *args)
            _poll(
                "every stream to have tokens",
                lambda: all(len(x) >= 4 for x in progress.values()),
                120,
            )
            # A deadline that passes during the outage; a resume timeout shorter than it.
            f_deadline = pool.submit(_grpc, main_url, extra["deadline"], 3.0, **late)
            f_short = pool.submit(_grpc, short.url, extra["short"], 300, **late)
            _poll("the two short-lived requests to stream", lambda: all(extra.values()), 30, 0.01)
            os.kill(stack.triton.process.pid, signal.SIGKILL)
            t_kill = time.monotonic()
            in_flight = {n for n, x in progress.items() if len(x) < MAX_NEW}
            outs = {name: f.result() for name, f in futs.items()}
            deadline_out, t_deadline = f_deadline.result(), time.monotonic()
            short_out = f_short.result()
    finally:
        stop.set()
        supervisor.join(60)
    assert sup.restarts["triton"] >= 1, "tritonserver was not restarted"
    assert len(in_flight) >= 14, f"only {sorted(in_flight)} were in flight at the kill"

    for name, (status, final) in outs.items():
        assert status == "ok", f"{name}: {status}: {final}"
        if name.startswith("seeded"):
            assert progress[name] == seeded_want[name.removeprefix("seeded-")], name
        else:
            assert progress[name] == want[int(name.rsplit("-", 1)[1])], name
        finish = final if name.startswith("openai") else final.finish_reason
        assert finish == "length", (name, finish)

    status, err = deadline_out
    assert status == "DEADLINE_EXCEEDED", (status, err)
    assert t_deadline > t_kill
    status, err = short_out
    assert status == "UNAVAILABLE" and "the target was down" in str(err), (status, err)

    main_in = sum(1 for n in in_flight if not n.startswith(("plain", "seeded-plain")))
    plain_in = len(in_flight) - main_in
    assert _resumed(stack.cfg.metrics_port) - resumed0[0] == main_in
    assert _resumed(plain.metrics_port) - resumed0[1] == plain_in

    # Nothing is left behind: every part holds no sequence, and the stack serves exactly.
    with Client(main_url, timeout=60) as c:
        _poll("the orchestrator to be idle", lambda: c.health().active_requests == 0, 30)
        assert (
            c.generate(prompt_ids=greedy[0], max_new_tokens=24, ignore_eos=True).token_ids
            == (ref(greedy[:1], 24)[0])
        )
    _poll(
        "the restarted Triton to hold no sequence",
        lambda: (
            _total(_samples(stack.cfg.triton_metrics_port), "flashmap_target_active_sequences") == 0
        ),
        30,
    )
