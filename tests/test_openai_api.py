"""The OpenAI-compatible HTTP API (orchestrator/openai_api/) against the real stack: Triton,
the drafter service (untrained FlashMap drafter) and the orchestrator as processes, driven by
the official `openai` client, plus raw HTTP for the SSE framing and for disconnects.

One stack for the module: a tiny random Qwen3 with a tokenizer and a chat template, 2 KV
slots and a queue of 1 (so queue-full is reachable). Greedy outputs are compared with the
in-process autoregressive decoder (stack_helpers.Reference, which rules out near-ties), so
"T = 0 equals the target alone" is checked token for token through the HTTP front end.
The last tests run the app in-process over a stub orchestrator for the status mapping of
failures a live stack cannot be made to produce on demand.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from flashmap.tokenizer import TextTokenizer
from flashmap_cli.stack import Stack, StackConfig
from tests.stack_helpers import (  # noqa: F401 - target_dir, ref, one_thread_per_process: fixtures
    _poll,
    _samples,
    _total,
    one_thread_per_process,
    ref,
    target_dir,
)

VOCAB = 512


@pytest.fixture(scope="module")
def stack(target_dir, tmp_path_factory):
    # speculation="full": per-request draft settings are checked on drafted rounds (the untrained
    # drafter would make the speculation controller turn drafting off).
    cfg = StackConfig.on_free_ports(
        target_dir=str(target_dir),
        n_slots=2,
        max_queue=1,
        max_seq_len=1024,
        speculation="full",
        log_dir=str(tmp_path_factory.mktemp("logs-openai")),
    )
    with Stack(cfg) as st:
        yield st


@pytest.fixture(scope="module")
def oai(stack) -> openai.OpenAI:
    # No retries: a 429 or 503 must reach the test, not be retried away.
    with openai.OpenAI(
        base_url=stack.cfg.http_url, api_key="unused", max_retries=0, timeout=120
    ) as c:
        yield c


@pytest.fixture(scope="module")
def model(oai) -> str:
    (m,) = oai.models.list().data
    return m.id


def _prompts(n: int, seed: int, lo: int = 2, hi: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def _idle(stack) -> bool:
    h = httpx.get(f"http://{stack.cfg.host}:{stack.cfg.http_port}/health", timeout=10).json()
    from flashmap.client import DrafterAdmin

    admin = DrafterAdmin(stack.cfg.drafter_url, token=stack.cfg.drafter_token)
    try:
        drafter_active = admin.stats().active_sequences
    finally:
        admin.close()
    triton_active = _total(
        _samples(stack.cfg.triton_metrics_port), "flashmap_target_active_sequences"
    )
    return (
        h["active_requests"] == 0
        and h["queued_requests"] == 0
        and triton_active == 0
        and drafter_active == 0
    )


# ============================================================================= the openai client


@pytest.mark.timeout(180)
def test_models_and_health(stack, oai, model):
    assert model == Path(stack.cfg.target_dir).name
    assert oai.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")
    h = httpx.get(f"http://{stack.cfg.host}:{stack.cfg.http_port}/health", timeout=10)
    assert h.status_code == 200 and h.json()["target_ready"] is True


@pytest.mark.timeout(180)
def test_completions_greedy_equal_the_target_alone(oai, model, ref):
    """Token-id prompts, T = 0, speculative through the stack: the ids (return_token_ids), the
    text, the usage and the finish reason, non-streamed and streamed, equal the in-process
    autoregressive decoder's output."""
    prompts = _prompts(4, seed=1)
    max_new = 24
    expected = ref(prompts, max_new)
    drafts = 0
    for p, exp in zip(prompts, expected):
        extra = {"ignore_eos": True, "return_token_ids": True}
        r = oai.completions.create(
            model=model, prompt=p, max_tokens=max_new, temperature=0, extra_body=extra
        )
        (c,) = r.choices
        assert c.token_ids == exp and c.prompt_token_ids == p
        assert c.finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
            len(p),
            max_new,
            len(p) + max_new,
        )
        fm = r.model_extra["flashmap"]
        assert (
            fm["rounds"] >= 1
            and len(fm["accepted_per_slot"]) == 16
            and "mean_acceptance_length" in fm
        )
        drafts += fm["drafts"]

        chunks = list(
            oai.completions.create(
                model=model,
                prompt=p,
                max_tokens=max_new,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
            )
        )
        ids = [t for ch in chunks for cc in ch.choices for t in cc.token_ids]
        assert ids == exp
        assert "".join(cc.text for ch in chunks for cc in ch.choices) == c.text
        finish = [cc.finish_reason for ch in chunks for cc in ch.choices if cc.finish_reason]
        assert finish == ["length"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == max_new
        assert all(ch.usage is None for ch in chunks[:-1])
        # The speculative statistics ride on the chunk with the finish reason.
        (fin,) = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert fin.model_extra["flashmap"]["rounds"] >= 1
    assert drafts > 0, "the drafter never took part: this was not speculative decoding"


@pytest.mark.timeout(180)
def test_chat_renders_the_checkpoint_template(oai, model, ref, target_dir):
    """The prompt is the checkpoint's chat template as transformers renders it (with the
    generation prompt); the answer equals the target alone on those ids, streamed or not."""
    from transformers import AutoTokenizer

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3 + 3?"},
    ]
    hf = AutoTokenizer.from_pretrained(target_dir)
    prompt_ids = hf(
        hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    max_new = 20
    (exp,) = ref([prompt_ids], max_new)
    extra = {"ignore_eos": True, "return_token_ids": True}
    r = oai.chat.completions.create(
        model=model,
        messages=messages,
        max_completion_tokens=max_new,
        temperature=0,
        extra_body=extra,
    )
    (c,) = r.choices
    assert c.prompt_token_ids == prompt_ids and c.token_ids == exp
    assert c.message.role == "assistant" and c.finish_reason == "length"
    assert (
        c.message.content == TextTokenizer(target_dir).decode(exp) or "\ufffd" in c.message.content
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")

    chunks = list(
        oai.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_new,
            temperature=0,
            stream=True,
            extra_body=extra,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content
    assert [t for ch in chunks for t in ch.choices[0].token_ids] == exp
    assert (
        chunks[-1].choices[0].finish_reason == "length"
        and chunks[-1].object == "chat.completion.chunk"
    )
    assert len({ch.id for ch in chunks}) == 1


@pytest.mark.timeout(120)
def test_a_template_without_thinking_or_tools_says_so(oai, model):
    """The target's ChatML template neither thinks nor renders tools: the model card says so,
    a chat response says thinking is unsupported (whatever chat_template_kwargs ask), and tools
    are refused rather than left out of the prompt."""
    card = oai.models.retrieve(model)
    assert card.model_extra["chat_template"] == {
        "template": True,
        "thinking": False,
        "tools": False,
    }
    r = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert r.model_extra["thinking"] == "unsupported"
    assert "reasoning_content" not in r.choices[0].message.model_extra
    tools = [{"type": "function", "function": {"name": "f"}}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="does not render tools"):
            oai.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "hi"}],
                tools=tools,
                stream=stream,
            )


@pytest.mark.timeout(120)
def test_grpc_chat_messages_equal_the_http_chat(stack, oai, model):
    """Both front ends build a chat prompt the same way (Orchestrator.make_request): gRPC
    Generate with messages gives the tokens the OpenAI chat endpoint gives."""
    from flashmap.client import Client, InvalidArgument

    messages = [{"role": "user", "content": "Tell me a story."}]
    r = oai.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    with Client(stack.cfg.url, timeout=60) as c:
        out = c.generate(messages=messages, max_new_tokens=12, ignore_eos=True)
        assert (
            out.token_ids == r.choices[0].token_ids and out.prompt_tokens == r.usage.prompt_tokens
        )
        with pytest.raises(InvalidArgument, match="messages must be a non-empty list"):
            c.generate(messages=[], max_new_tokens=4)


@pytest.mark.timeout(180)
def test_chat_default_max_tokens_and_eos(oai, model):
    """Without max_tokens a chat request may use the rest of the context and ends at the
    checkpoint's end-of-turn id (or its length), like any OpenAI chat model."""
    r = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens == len(c.token_ids) > 0
    if c.finish_reason == "length":
        assert r.usage.prompt_tokens + r.usage.completion_tokens == 1024


@pytest.mark.timeout(180)
def test_stop_seed_and_sampling(oai, model, target_dir):
    """A stop string cuts the text (and the ids and usage) before it; a seed reproduces a
    sampled answer; top_k and top_p reach the sampler."""
    from flashmap.tokenizer import IncrementalDecoder

    base = dict(
        model=model,
        prompt="the quick brown fox",
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    full = oai.completions.create(**base).choices[0]
    text = full.text
    # The server cuts ids and text at the same token (Orchestrator.stream), so pick a stop string
    # that starts where a token's text starts: then the text ends exactly before it.
    dec = IncrementalDecoder(TextTokenizer(target_dir))
    dec.push(full.token_ids)
    assert dec.text == text
    starts = [e for e, nxt in zip(dec.ends, dec.ends[1:]) if nxt - e >= 2 and e > 0]
    cut = next(e for e in starts if text.index(text[e : e + 2]) == e)
    stop = text[cut : cut + 2]
    for s in (stop, [stop, "never-appears"]):
        r = oai.completions.create(**base, stop=s)
        c = r.choices[0]
        assert c.text == text[:cut] and c.finish_reason == "stop"
        assert c.token_ids == full.token_ids[
            : len(c.token_ids)
        ] and r.usage.completion_tokens == len(c.token_ids)
    streamed = list(oai.completions.create(**base, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == text[:cut]

    # Speculation off: with drafts, the controller's timing-dependent draft lengths change how
    # the seeded generator is consumed, so equal seeds give equally distributed, not equal, text.
    sampled = dict(
        model=model,
        prompt="the quick brown fox",
        max_tokens=16,
        temperature=1.0,
        top_p=0.9,
        extra_body={"ignore_eos": True, "top_k": 50, "max_draft_tokens": 0},
    )
    a = oai.completions.create(**sampled, seed=5).choices[0].text
    assert oai.completions.create(**sampled, seed=5).choices[0].text == a
    others = {oai.completions.create(**sampled, seed=s).choices[0].text for s in (6, 7, 8)}
    assert others - {a}, "different seeds never changed a sampled answer"


@pytest.mark.timeout(180)
def test_per_request_draft_steps_and_speculation_off(oai, model, ref):
    p = _prompts(1, seed=3)[0]
    (exp,) = ref([p], 20)
    base = dict(model=model, prompt=p, max_tokens=20, temperature=0)
    r2 = oai.completions.create(
        **base, extra_body={"ignore_eos": True, "return_token_ids": True, "draft_steps": 2}
    )
    assert r2.choices[0].token_ids == exp
    assert (
        r2.model_extra["flashmap"]["draft_steps"] == 2 and r2.model_extra["flashmap"]["drafts"] > 0
    )
    off = oai.completions.create(
        **base, extra_body={"ignore_eos": True, "return_token_ids": True, "max_draft_tokens": 0}
    )
    assert off.choices[0].token_ids == exp
    assert (
        off.model_extra["flashmap"]["drafts"] == 0 and off.model_extra["flashmap"]["rounds"] >= 19
    )


@pytest.mark.timeout(120)
def test_bad_requests_are_openai_errors(stack, oai, model):
    """Bad input: the client raises the matching error class; the body is OpenAI's error shape
    with the message saying what is wrong (and the field, where there is one)."""
    ok = dict(model=model, prompt="hello", max_tokens=4)
    cases = [
        (dict(n=2), openai.BadRequestError, "n must be 1", "n"),
        (dict(temperature=-1), openai.BadRequestError, "temperature", None),
        (dict(top_p=0), openai.BadRequestError, "top_p", None),
        (dict(prompt=""), openai.BadRequestError, "empty", None),
        (dict(prompt=[1, VOCAB + 5]), openai.BadRequestError, "vocabulary", None),
        (dict(max_tokens=0), openai.BadRequestError, "max_new_tokens", None),
        (dict(max_tokens=5000), openai.BadRequestError, "context", None),
        (dict(prompt=["a", "b"]), openai.BadRequestError, "one prompt", "prompt"),
        (dict(seed=-3), openai.BadRequestError, "seed", None),
        (dict(echo=True), openai.BadRequestError, "echo", "echo"),
        (dict(logprobs=21), openai.BadRequestError, "top_logprobs must be in 0..20", None),
        (
            dict(presence_penalty=0.5),
            openai.BadRequestError,
            "presence_penalty",
            "presence_penalty",
        ),
        (
            dict(extra_body={"draft_step": 2}),
            openai.BadRequestError,
            "unsupported field 'draft_step'",
            "draft_step",
        ),
        (dict(extra_body={"draft_steps": 0}), openai.BadRequestError, "draft_steps", None),
        (
            dict(extra_body={"max_draft_tokens": -1}),
            openai.BadRequestError,
            "max_draft_tokens",
            None,
        ),
        (dict(model="gpt-4o"), openai.NotFoundError, "does not exist", "model"),
    ]
    for kw, cls, words, param in cases:
        for stream in (False, True):
            with pytest.raises(cls) as e:
                oai.completions.create(**{**ok, **kw, "stream": stream})
            err = e.value.body
            assert words in err["message"], (kw, err)
            assert err["param"] == param and err["type"] == "invalid_request_error", (kw, err)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=[])
    assert "messages" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model=model,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ],
        )
    assert "text content" in e.value.body["message"]
    # Raw HTTP: not JSON, unknown route.
    base = f"http://{stack.cfg.host}:{stack.cfg.http_port}"
    r = httpx.post(
        f"{base}/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.get(f"{base}/v1/nothing-here")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    # Still serving.
    assert oai.completions.create(**ok).choices[0].finish_reason in ("stop", "length")


@pytest.mark.timeout(180)
def test_queue_full_is_429(stack, oai, model):
    """2 KV slots and a queue of 1: with 3 long requests in, a 4th gets 429 (streamed or not),
    and the three finish normally."""
    long = dict(
        model=model, prompt="x", max_tokens=300, temperature=0, extra_body={"ignore_eos": True}
    )
    base = f"http://{stack.cfg.host}:{stack.cfg.http_port}"
    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(oai.completions.create, **long) for _ in range(3)]
        _poll(
            "2 active and 1 queued requests",
            lambda: (lambda h: h["active_requests"] == 2 and h["queued_requests"] == 1)(
                httpx.get(f"{base}/health", timeout=10).json()
            ),
            60,
            0.02,
        )
        for stream in (False, True):
            with pytest.raises(openai.RateLimitError) as e:
                oai.completions.create(model=model, prompt="y", max_tokens=4, stream=stream)
            assert "queue full" in e.value.body["message"] and e.value.status_code == 429
        outs = [f.result() for f in futs]
    assert all(
        o.choices[0].finish_reason == "length" and o.usage.completion_tokens == 300 for o in outs
    )


# ============================================================================= raw HTTP


@pytest.mark.timeout(120)
def test_sse_framing(stack, model):
    """The stream is text/event-stream: `data: <json>` events separated by a blank line, chunks
    of one id, the finish chunk, the usage chunk, then `data: [DONE]` and nothing after it."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{stack.cfg.http_url}/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = []
    for ev in events[:-2]:
        assert ev.startswith("data: ") and "\n" not in ev, repr(ev)
        payloads.append(json.loads(ev[len("data: ") :]))
    assert len({p["id"] for p in payloads}) == 1
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finish = [p for p in payloads if p["choices"] and p["choices"][0]["finish_reason"]]
    assert (
        len(finish) == 1
        and finish[0]["choices"][0]["finish_reason"] == "length"
        and "flashmap" in finish[0]
    )
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 12


@pytest.mark.timeout(180)
def test_client_disconnect_frees_the_slots(stack, model):
    """A client that goes away (mid-stream, or while waiting for a whole response) aborts its
    request: orchestrator, Triton and the drafter all let go of the sequence."""
    aborts0 = _total(_samples(stack.cfg.metrics_port), "flashmap_requests_total", status="abort")
    body = {
        "model": model,
        "prompt": "abc",
        "max_tokens": 800,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    got = 0
    with httpx.stream("POST", f"{stack.cfg.http_url}/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            got += line.startswith("data: {")
            if got >= 3:
                break  # leaving the block closes the connection mid-stream
    assert got >= 3
    _poll(
        "orchestrator, target and drafter to be idle after a dropped stream",
        lambda: _idle(stack),
        30,
        0.1,
    )

    # Non-streamed: the client's read timeout fires long before 800 tokens are done.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stack.cfg.http_url}/completions", json={**body, "stream": False}, timeout=1.5)
    _poll(
        "orchestrator, target and drafter to be idle after a dropped request",
        lambda: _idle(stack),
        30,
        0.1,
    )
    aborts1 = _total(_samples(stack.cfg.metrics_port), "flashmap_requests_total", status="abort")
    assert aborts1 - aborts0 == 2


# ============================================================================= failures, in process


class _StubOrchestrator:
    """Just enough of Orchestrator for create_app: a request stream that fails as told."""

    def __init__(self, failure):
        from types import SimpleNamespace

        from orchestrator.config import OrchestratorConfig

        self.info = SimpleNamespace(model_name="stub", max_seq_len=64)
        self.cfg = OrchestratorConfig()
        self.tokenizer = None
        self.health = SimpleNamespace(ok=True)
        self.failure = failure
        self.active, self.waiting, self.drafter = {}, [], None

    def make_request(self, prompt, options, request_id=""):
        from flashmap.types import GenerationRequest

        return GenerationRequest([1, 2], 4, request_id=request_id)

    async def request_async(self, build, *args):
        return build(*args)

    async def stream(self, gen, stops):
        from orchestrator.requests import Outcome, Piece

        if isinstance(self.failure, Exception):
            raise self.failure
        if self.failure[0] == "after-a-piece":
            yield Piece([5], "five")
            yield Outcome.failed(*self.failure[1:])
            return
        yield Outcome.failed(*self.failure)


@pytest.mark.parametrize(
    "failure,status,code",
    [
        (("UNAVAILABLE", "target verify failed: Triton is down"), 503, "unavailable"),
        (("RESOURCE_EXHAUSTED", "queue full (1 waiting requests)"), 429, "resource_exhausted"),
        (("INTERNAL", "something broke"), 500, "internal"),
        (RuntimeError("a bug"), 500, "internal"),
    ],
)
@pytest.mark.unit
def test_failures_map_to_http_status(failure, status, code):
    import grpc
    from fastapi.testclient import TestClient

    from orchestrator.openai_api.server import create_app

    if isinstance(failure, tuple):
        failure = (getattr(grpc.StatusCode, failure[0]), failure[1])
    with TestClient(create_app(_StubOrchestrator(failure)), raise_server_exceptions=False) as c:
        for stream in (False, True):
            r = c.post("/v1/completions", json={"prompt": "hi", "stream": stream})
            assert r.status_code == status, r.text
            err = r.json()["error"]
            assert err["code"] == code and set(err) == {"message", "type", "param", "code"}
            if not isinstance(failure, Exception):
                assert err["message"] == failure[1]


@pytest.mark.unit
def test_error_after_the_stream_started_is_an_error_event():
    """Headers (200) are gone once a piece streamed: a later failure is an `error` event, which
    the openai client raises as APIError."""
    import grpc
    from fastapi.testclient import TestClient

    from orchestrator.openai_api.server import create_app

    app = create_app(
        _StubOrchestrator(
            ("after-a-piece", grpc.StatusCode.UNAVAILABLE, "target verify failed: gone")
        )
    )
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "stream": True})
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert json.loads(events[0][6:])["choices"][0]["text"] == "five"
    assert json.loads(events[1][6:])["error"]["message"] == "target verify failed: gone"
    assert events[-1] == "data: [DONE]"
    client = openai.OpenAI(
        base_url="http://stub/v1",
        api_key="x",
        max_retries=0,
        http_client=httpx.Client(
            transport=httpx.MockTransport(
                lambda req: httpx.Response(
                    200, headers={"content-type": "text/event-stream"}, content=r.content
                )
            )
        ),
    )
    with pytest.raises(openai.APIError, match="gone"):
        list(client.completions.create(model="stub", prompt="hi", stream=True))


@pytest.mark.unit
def test_body_must_be_json():
    """curl -d without a JSON content type, or a body that is not an object: a 400 that says so."""
    import grpc
    from fastapi.testclient import TestClient

    from orchestrator.openai_api.server import create_app

    with TestClient(create_app(_StubOrchestrator((grpc.StatusCode.UNAVAILABLE, "x")))) as c:
        r = c.post(
            "/v1/completions",
            content=b'{"prompt": "hi"}',
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert (
            r.status_code == 400
            and "Content-Type: application/json" in r.json()["error"]["message"]
        )
        r = c.post("/v1/chat/completions", json={"messages": "hi"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert c.get("/v1/completions").status_code == 405
