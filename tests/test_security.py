"""Trust boundaries and failure handling, against the real processes on 127.0.0.1 (issue 15).

Each test does to one stack (with an API key) what an attacker or a fault would, and fails
when the stack does not hold: attacks through Triton (no key; with the key: foreign ids,
positions a sequence did not commit, END for ids it does not hold, shared memory) and the
drafter (no token) refused while greedy streams stay identical to the target alone; the
public API key, message, prompt, request-id and field limits, and fuzzed requests answered
with INVALID_ARGUMENT (never UNKNOWN or INTERNAL, no traceback logged) while a stream beside
them goes on; many concurrent cancels and deadlines, after which every slot is free on all
three parts and a full batch is exact; a paused Triton ending requests within the bound with
Health answering; a killed Triton Python stub seen by health and repaired by the supervisor, the
stream it cut continuing exactly on the restarted Triton, exact output again. Every request
ends with one status: none is lost.

Over 500 lines in one file because every test shares one stack, which takes seconds to start.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from flashmap.auth import DRAFTER_TOKEN_HEADER, TARGET_KEY_GRPC_HEADER
from flashmap.client import AsyncClient, Client, DrafterAdmin, FlashMapError
from flashmap.metrics import scrape, totals
from flashmap.v1 import drafter_pb2, drafter_pb2_grpc, serving_pb2, serving_pb2_grpc
from tests.stack_helpers import wait_until

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parent.parent
BOUND_S = 4.0  # the orchestrator's deadline for a call to Triton
CANCELS = 1000
FUZZED = 1000
# A greedy stream that prints each chunk's arrival, in a process of its own.
_STREAM = """
import sys
from flashmap.client import Client
for _ in Client(sys.argv[1], api_key=sys.argv[2]).generate_stream(prompt_ids=[5, 6, 7], max_new_tokens=400):
    print(flush=True)
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from flashmap_cli.stack import Stack, StackConfig
    from target_service.random_checkpoint import make_random_qwen3

    target = make_random_qwen3(
        tmp_path_factory.mktemp("sec") / "tiny-qwen3", vocab_size=512, seed=3
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        cfg = StackConfig.on_free_ports(
            target_dir=str(target),
            n_slots=4,
            max_seq_len=1024,
            api_key="test-key",
            speculation="full",
            target_timeout_s=BOUND_S,
            log_dir=str(tmp_path_factory.mktemp("logs")),
        )
        with Stack(cfg) as st:
            yield st


@pytest.fixture(scope="module")
def ref(stack):
    """Greedy outputs of the target alone (in-process engine): prompts -> token ids."""
    from flashmap.inprocess import decode
    from flashmap.types import GenerationRequest, SamplingParams
    from target_service.engine import TargetEngine

    engine = TargetEngine(stack.cfg.target_dir, n_slots=8, max_seq_len=1024)

    def greedy(prompts: list[list[int]], max_new: int) -> list[list[int]]:
        reqs = [GenerationRequest(p, max_new, SamplingParams()) for p in prompts]
        return [r.token_ids for r in decode(engine, reqs)]

    greedy.vocab_size = engine.vocab_size
    return greedy


# ----------------------------------------------------------------------------- helpers


def prompts_for(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(rng.integers(4, 20))).tolist() for _ in range(n)]


def client(stack, timeout: float | None = 120) -> Client:
    return Client(stack.cfg.url, timeout=timeout, api_key=stack.cfg.api_key)


def streams_stay_exact(stack, ref, attack, n: int = 4, max_new: int = 48) -> None:
    """Run n greedy streams while attack(done) runs in a thread; every output must equal the
    target alone's."""
    prompts = prompts_for(ref.vocab_size, n, seed=11)
    want = ref(prompts, max_new)
    done = threading.Event()
    t = threading.Thread(target=attack, args=(done,))
    t.start()
    try:
        with client(stack) as c, ThreadPoolExecutor(n) as pool:
            outs = list(
                pool.map(
                    lambda p: c.generate(prompt_ids=p, max_new_tokens=max_new, ignore_eos=True),
                    prompts,
                )
            )
    finally:
        done.set()
        t.join(60)
    assert [o.token_ids for o in outs] == want, "a stream's output changed while the attack ran"


def health_status(url: str) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(url) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
        except grpc.RpcError as e:
            return e.code().name


def triton_infer(stack, key, corrid: int, tokens, start_pos: int, start: bool, end=False):
    """One raw verify request to Triton as an attacker would send it (on the model's gRPC
    stream); what refused it (None = OK)."""
    from flashmap.triton_stream import StreamBroken, StreamError, call_once, infer_request

    inputs = {
        "TOKENS": np.asarray([tokens], np.int64),
        "START_POS": np.asarray([[start_pos]], np.int64),
    }
    request = infer_request("flashmap_target", inputs, [], corrid, start, end)
    try:
        call_once(
            f"{stack.cfg.host}:{stack.cfg.triton_grpc_port}",
            request,
            ((TARGET_KEY_GRPC_HEADER, key),) if key else (),
            timeout_s=20,
        )
        return None
    except StreamBroken as e:
        return e.status.name if e.status is not None else str(e)
    except StreamError as e:
        return str(e)


def active_everywhere(stack) -> dict:
    """Requests or sequences each part still holds."""
    o = totals(scrape(f"http://{stack.cfg.host}:{stack.cfg.metrics_port}/metrics"))
    t = totals(scrape(stack.triton.metrics_url))
    with DrafterAdmin(stack.cfg.drafter_url, token=stack.cfg.drafter_token) as admin:
        d = admin.stats().active_sequences
    return {
        "orchestrator_active": o.get("flashmap_active_requests", 0),
        "orchestrator_queued": o.get("flashmap_queued_requests", 0),
        "triton_active": t.get("flashmap_target_active_sequences", 0),
        "drafter_active": d,
    }


def stub_pids(stack) -> list[int]:
    """The Python backend stubs under this stack's tritonserver."""
    out = subprocess.run(
        ["pgrep", "-f", "triton_python_backend_stub"], capture_output=True, text=True
    ).stdout
    mine = set()
    for p in (int(x) for x in out.split()):
        try:
            ppid = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == stack.triton.process.pid:
            mine.add(p)
    return sorted(mine)


# ----------------------------------------------------------------------------- Triton


def test_triton_refuses_what_only_the_orchestrator_may_do(stack, ref):
    """Without the key: inference, END, shared memory, model control, logging and statistics
    are refused while greedy streams run (and stay exact); with the key (an insider): positions
    a sequence did not commit and END for ids it does not hold."""
    import tritonclient.grpc as tc
    from tritonclient.utils import InferenceServerException

    tried: dict[str, list] = {}

    def attack(done: threading.Event) -> None:
        rng = random.Random(0)
        while not done.is_set() and len(tried.get("verify without key", ())) < 100:
            corrid = rng.getrandbits(62) | 1
            tried.setdefault("verify without key", []).append(
                triton_infer(stack, None, corrid, [5, 6], 40, False)
            )
            tried.setdefault("END without key", []).append(
                triton_infer(stack, None, corrid, [], 0, False, end=True)
            )

    streams_stay_exact(stack, ref, attack)
    c = tc.InferenceServerClient(f"{stack.cfg.host}:{stack.cfg.triton_grpc_port}")
    for name, call in [
        (
            "register shared memory without key",
            lambda: c.register_system_shared_memory("x", "/dev/shm/anything", 64),
        ),
        ("load model without key", lambda: c.load_model("flashmap_target")),
        (
            "update log settings without key",
            lambda: c.update_log_settings({"log_verbose_level": 1}),
        ),
        ("inference statistics without key", lambda: c.get_inference_statistics()),
    ]:
        try:
            call()
            tried[name] = [None]
        except InferenceServerException as e:
            tried[name] = [e.status() or e.message()]
    c.close()
    key = stack.cfg.target_key
    corrid = random.getrandbits(62) | 1
    assert triton_infer(stack, key, corrid, [3, 4, 5], 0, True) is None  # its own sequence: fine
    tried["with key: START_POS past the sequence"] = [
        triton_infer(stack, key, corrid, [7], 40, False)
    ]
    tried["with key: START_POS inside a drafted, unaccepted span"] = [
        triton_infer(stack, key, corrid, [7], 1, False)
    ]
    tried["with key: END for an id it does not hold"] = [
        triton_infer(stack, key, corrid ^ 2, [], 0, False, end=True)
    ]
    triton_infer(stack, key, corrid, [], 0, False, end=True)
    went_through = {k: sum(v is None for v in vs) for k, vs in tried.items()}
    assert not any(went_through.values()), f"attacks that went through: {went_through}"
    assert sum(len(v) for v in tried.values()) > 10


# ----------------------------------------------------------------------------- drafter


def test_drafter_refuses_calls_without_its_token(stack, ref):
    """Admin and draft calls without the token (or with a wrong one) are UNAUTHENTICATED while
    the streams stay exact; the holder of the token still can, and health stays open."""
    url = stack.cfg.drafter_url
    codes: list = []

    def attack(done: threading.Event) -> None:
        with grpc.insecure_channel(url) as ch:
            stub = drafter_pb2_grpc.DrafterStub(ch)
            calls = [
                lambda: stub.SetSteps(drafter_pb2.SetStepsRequest(steps=64), timeout=5),
                lambda: stub.Release(
                    drafter_pb2.ReleaseRequest(seq_ids=[str(i) for i in range(100)]), timeout=5
                ),
                lambda: stub.Stats(drafter_pb2.StatsRequest(), timeout=5),
                lambda: list(stub.Draft(iter([drafter_pb2.DraftRequest(call_id=1)]), timeout=5)),
                lambda: stub.SetSteps(
                    drafter_pb2.SetStepsRequest(steps=64),
                    timeout=5,
                    metadata=((DRAFTER_TOKEN_HEADER, "guess"),),
                ),
            ]
            while not done.is_set() and len(codes) < 100:
                for call in calls:
                    try:
                        call()
                        codes.append("OK")
                    except grpc.RpcError as e:
                        codes.append(e.code().name)

    streams_stay_exact(stack, ref, attack)
    assert codes and set(codes) == {"UNAUTHENTICATED"}, sorted(set(codes))
    with DrafterAdmin(url, token=stack.cfg.drafter_token) as admin:
        assert admin.get_steps() == stack.cfg.steps
    assert health_status(url) == "SERVING"


# ----------------------------------------------------------------------------- public API


def test_public_api_key_limits_and_fuzz(stack):
    """A wrong API key: UNAUTHENTICATED, Health open. A 10 MB prompt: RESOURCE_EXHAUSTED, while
    a stream beside it (in a process of its own: encoding 10 MB here holds this process's GIL)
    goes on. Bad fields and fuzzed requests: INVALID_ARGUMENT, never UNKNOWN or INTERNAL, and
    no traceback in the orchestrator's log."""
    url = stack.cfg.url
    codes: dict[str, int] = {}

    def note(code):
        codes[code] = codes.get(code, 0) + 1

    with Client(url, timeout=30, api_key="wrong") as c:
        with pytest.raises(FlashMapError) as e:
            c.generate(prompt_ids=[1, 2], max_new_tokens=2)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED, e.value
        note("UNAUTHENTICATED")
        assert c.health().target_ready  # Health stays open
    streamer = subprocess.Popen(
        [sys.executable, "-c", _STREAM, url, stack.cfg.api_key],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    arrived = 0
    while arrived < 40 and streamer.stdout.readline():  # the stream is under way
        arrived += 1
    big = "x" * (10 << 20)
    refusal_s = []
    with Client(url, timeout=30, api_key=stack.cfg.api_key) as c:
        c.health()
        for _ in range(3):
            t0 = time.perf_counter()
            with pytest.raises(FlashMapError) as e:
                c.generate(prompt=big, max_new_tokens=4)
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
            refusal_s.append(time.perf_counter() - t0)
    note("RESOURCE_EXHAUSTED")
    streamer.stdout.read()
    assert streamer.wait(60) == 0, "the stream beside the 10 MB refusals failed"
    # Refused before the orchestrator parses it (flashmap.grpc_serving); the bound is loose, the
    # refusal takes tens of milliseconds on a quiet machine.
    assert float(np.median(refusal_s)) < 2.0, refusal_s
    bad = [
        dict(prompt_ids=[1, 2], max_new_tokens=4, top_k=2**31),
        dict(prompt_ids=[1], max_new_tokens=4, request_id="r" * 1000),
        dict(prompt_ids=[], max_new_tokens=4),
        dict(prompt_ids=[10**9], max_new_tokens=4),
        dict(prompt_ids=[1], max_new_tokens=0),
        dict(prompt_ids=[1], max_new_tokens=4, temperature=-1.0),
        dict(prompt_ids=[1], max_new_tokens=4, top_p=0.0),
        dict(prompt_ids=[1], max_new_tokens=10**7),
        dict(prompt_ids=[1], max_new_tokens=4, draft_steps=1000),
        dict(prompt="x" * (2 << 20), max_new_tokens=4),
    ]
    with client(stack, timeout=30) as c:
        for kw in bad:
            try:
                c.generate(**kw)
                note("OK")
            except FlashMapError as e:
                note(e.code.name)
    # Fuzz: random bytes as a request, and random field values.
    rng = random.Random(1)
    md = (("authorization", f"Bearer {stack.cfg.api_key}"),)
    with grpc.insecure_channel(url) as ch:
        raw = ch.unary_stream(
            "/flashmap.v1.FlashMap/Generate",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        stub = serving_pb2_grpc.FlashMapStub(ch)
        for i in range(FUZZED):
            try:
                if i % 2:
                    list(
                        raw(
                            bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64))),
                            timeout=10,
                            metadata=md,
                        )
                    )
                else:
                    req = serving_pb2.GenerateRequest(
                        max_new_tokens=rng.choice([0, 1, 3, 2**32 - 1]),
                        temperature=rng.choice([0.0, -1.0, 1e30, 0.5]),
                        top_k=rng.choice([0, 1, 2**32 - 1]),
                        request_id=rng.choice(["", "a" * 300, "\x00\x01"]),
                    )
                    req.token_ids.ids.extend(rng.choice([[], [1, 2], [-5], [2**40]]))
                    if rng.random() < 0.3:
                        req.top_p = rng.choice([0.0, 2.0, float("nan")])
                    list(stub.Generate(req, timeout=10, metadata=md))
                note("OK")
            except grpc.RpcError as e:
                note(e.code().name)
    assert "UNKNOWN" not in codes and "INTERNAL" not in codes, codes
    assert codes.get("INVALID_ARGUMENT", 0) > FUZZED // 10, codes
    log_text = stack._log("orchestrator").read_text(errors="replace")
    assert "Traceback" not in log_text, "the orchestrator logged a traceback"


# ----------------------------------------------------------------------------- cancels


def test_cancels_and_deadlines_free_every_slot(stack, ref):
    """CANCELS requests cancelled or timed out at random points, 64 at a time: every one ends
    with one status, then every slot is free on all three parts and a full batch is exact."""
    rng = random.Random(2)
    outcome: dict[str, int] = {}

    async def one(c: AsyncClient, sem: asyncio.Semaphore):
        async with sem:
            kind = rng.choice(["deadline", "cancel"])
            prompt = [rng.randrange(3, ref.vocab_size) for _ in range(rng.randint(2, 12))]
            try:
                if kind == "deadline":
                    cc = AsyncClient(
                        stack.cfg.url, timeout=rng.uniform(0.01, 0.5), api_key=stack.cfg.api_key
                    )
                    try:
                        await cc.generate(prompt_ids=prompt, max_new_tokens=200, ignore_eos=True)
                    finally:
                        await cc.close()
                else:
                    agen = c.generate_stream(prompt_ids=prompt, max_new_tokens=200, ignore_eos=True)
                    async for _ in agen:
                        if rng.random() < 0.5:
                            break
                    await agen.aclose()
                outcome["finished"] = outcome.get("finished", 0) + 1
            except FlashMapError as e:
                outcome[e.code.name] = outcome.get(e.code.name, 0) + 1

    async def run():
        sem = asyncio.Semaphore(64)
        c = AsyncClient(stack.cfg.url, api_key=stack.cfg.api_key)
        try:
            await asyncio.gather(*[one(c, sem) for _ in range(CANCELS)])
        finally:
            await c.close()

    asyncio.run(run())
    assert sum(outcome.values()) == CANCELS, outcome  # none lost
    wait_until(
        "every slot free on orchestrator, Triton and drafter",
        lambda: not any(active_everywhere(stack).values()),
        60,
    )
    n_slots = stack.cfg.n_slots
    prompts = prompts_for(ref.vocab_size, n_slots, seed=5)
    with client(stack) as c, ThreadPoolExecutor(n_slots) as pool:
        got = list(
            pool.map(
                lambda p: c.generate(prompt_ids=p, max_new_tokens=24, ignore_eos=True).token_ids,
                prompts,
            )
        )
    assert got == ref(prompts, 24), "a full batch after the cancels was not exact"


# ----------------------------------------------------------------------------- faults


def test_paused_triton_ends_requests_within_the_bound(stack):
    """SIGSTOP tritonserver: a request ends with DEADLINE_EXCEEDED (or UNAVAILABLE) within the
    orchestrator's target timeout, and Health keeps answering; SIGCONT and it serves again."""
    pid = stack.triton.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        with client(stack, timeout=BOUND_S + 30) as c:
            with pytest.raises(FlashMapError) as e:
                c.generate(prompt_ids=[3, 4, 5], max_new_tokens=4)
            took = time.perf_counter() - t0
            h0 = time.perf_counter()
            c.health()
            health_s = time.perf_counter() - h0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert e.value.code.name in ("DEADLINE_EXCEEDED", "UNAVAILABLE"), e.value
    assert took < BOUND_S + 5, took
    assert health_s < 1.0, health_s
    with client(stack) as c:
        wait_until("the orchestrator to see the target again", lambda: c.health().target_ready, 30)
        c.generate(prompt_ids=[3, 4, 5], max_new_tokens=4)


def test_killed_triton_stub_is_seen_and_repaired(stack, ref):
    """kill -9 the Triton Python stub under a stream: health NOT_SERVING within seconds, the
    supervisor restarts Triton, health SERVING; the stream waited for the restarted target and
    ends exact (orchestrator.resume), and requests after it are exact too."""
    from flashmap_cli.stack import Supervisor

    stubs = stub_pids(stack)
    assert stubs, "no triton_python_backend_stub under this stack's tritonserver"
    stop = threading.Event()
    sup = Supervisor(stack, probe_interval_s=1.0, log=lambda m: None)
    th = threading.Thread(target=sup.run, args=(stop, 0.5), daemon=True)
    th.start()
    (first,) = prompts_for(ref.vocab_size, 1, seed=8)
    got: list[int] = []

    def stream() -> str:
        with client(stack, timeout=300) as c:
            for chunk in c.generate_stream(prompt_ids=first, max_new_tokens=400, ignore_eos=True):
                if chunk.finished:
                    return chunk.finish_reason
                got.extend(chunk.token_ids)
        return "no final chunk"

    try:
        with ThreadPoolExecutor(1) as pool, client(stack) as c:
            fut = pool.submit(stream)
            wait_until("the stream to start", lambda: len(got) >= 4, 60, 0.01)
            for p in stubs:
                os.kill(p, signal.SIGKILL)
            wait_until(
                "health NOT_SERVING",
                lambda: (
                    health_status(stack.cfg.url) == "NOT_SERVING" and not c.health().target_ready
                ),
                30,
            )
            assert len(got) < 400, "the stream ended before the stub was killed"
            wait_until(
                "Triton restarted and health SERVING",
                lambda: health_status(stack.cfg.url) == "SERVING",
                180,
                0.5,
            )
            assert fut.result(timeout=300) == "length"
        assert got == ref([first], 400)[0], "the stream did not continue exactly"
        prompts = prompts_for(ref.vocab_size, 3, seed=9)
        with client(stack) as c:
            got_after = [
                c.generate(prompt_ids=p, max_new_tokens=24, ignore_eos=True).token_ids
                for p in prompts
            ]
        assert got_after == ref(prompts, 24), "output after the restart was not exact"
    finally:
        stop.set()
        th.join(60)
    assert sup.restarts["triton"] >= 1


@pytest.mark.unit
def test_message_limits_refuse_before_parsing():
    """Over max_message_bytes but within the transport limit: refused by add_service without
    parsing (RESOURCE_EXHAUSTED naming the limit); over the transport limit: gRPC's own
    refusal (RESOURCE_EXHAUSTED); under the limit: served."""
    import asyncio

    import grpc

    from flashmap.grpc_serving import add_service
    from flashmap.v1 import serving_pb2, serving_pb2_grpc

    class Echo(serving_pb2_grpc.FlashMapServicer):
        async def Generate(self, request, context):
            yield serving_pb2.GenerateResponse(request_id=str(len(request.text)))

    def call(port, size):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            try:
                stub = serving_pb2_grpc.FlashMapStub(ch)
                return "".join(
                    r.request_id
                    for r in stub.Generate(serving_pb2.GenerateRequest(text="x" * size), timeout=10)
                )
            except grpc.RpcError as e:
                return e.code(), e.details()

    async def main():
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 40_000)])
        add_service(
            server,
            Echo(),
            serving_pb2.DESCRIPTOR.services_by_name["FlashMap"],
            max_message_bytes=10_000,
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return [await asyncio.to_thread(call, port, n) for n in (5_000, 20_000, 80_000)]
        finally:
            await server.stop(None)

    small, middle, large = asyncio.run(main())
    assert small == "5000"
    assert (
        middle[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        and "more than the limit of 10000" in middle[1]
    )
    assert large[0] == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_orchestrator_serves_tls_and_reflection_when_asked(stack, tmp_path):
    """--tls-cert / --tls-key and --reflection reach the public port: a TLS client that trusts
    the certificate gets health and the reflection service's list (with the API key)."""
    import shutil
    import subprocess
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from flashmap.grpc_serving import free_ports

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    port, metrics = free_ports(2)
    c = stack.cfg
    proc = stack._spawn(
        "orchestrator-tls",
        [
            "orchestrator.server",
            "--host",
            c.host,
            "--port",
            str(port),
            "--metrics-port",
            str(metrics),
            "--http-port",
            "0",
            "--target-url",
            f"{c.host}:{c.triton_grpc_port}",
            "--drafter-url",
            "",
            "--tokenizer-dir",
            c.target_dir,
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            "--reflection",
        ],
    )
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{port}", creds) as ch:
            deadline = time.monotonic() + 120
            while True:
                try:
                    status = (
                        health_pb2_grpc.HealthStub(ch)
                        .Check(health_pb2.HealthCheckRequest(), timeout=2)
                        .status
                    )
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, (
                    "the TLS orchestrator did not come up"
                )
                time.sleep(0.5)
            reply = next(
                reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                    timeout=10,
                    metadata=(("authorization", f"Bearer {c.api_key}"),),
                )
            )
            names = [s.name for s in reply.list_services_response.service]
            assert "flashmap.v1.FlashMap" in names, names
    finally:
        proc.terminate()
        proc.wait(30)
