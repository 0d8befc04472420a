"""Trust boundaries and failure handling, against the real processes on 127.0.0.1 (issue 15).

The probes are bench/probe_security.py's (its script writes docs/results/security.md); here
each one runs against one stack with an API key, and fails the suite when the stack does
not hold: attacks through Triton and the drafter refused while greedy streams stay exact,
limits and fuzzed requests answered with INVALID_ARGUMENT (no UNKNOWN / INTERNAL, no
traceback), 1,000 cancels and deadlines leaving every slot free, a paused Triton ending
requests within the bound, and a killed Triton stub seen by health and repaired.
"""

from __future__ import annotations

import pytest

from bench import probe_security as probes

pytestmark = pytest.mark.timeout(600)

BOUND_S = 4.0


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
    return probes.Reference(stack.cfg.target_dir)


def test_triton_refuses_what_only_the_orchestrator_may_do(stack, ref):
    r = probes.probe_triton(stack, ref)
    assert r["attacks_refused"] > 10 and r["streams_exact"] == r["streams"]


def test_drafter_refuses_calls_without_its_token(stack, ref):
    r = probes.probe_drafter(stack, ref)
    assert r["refused"] == r["calls_without_token"] > 0


def test_public_api_key_limits_and_fuzz(stack):
    r = probes.probe_public_api(stack)
    assert r["codes"].get("UNAUTHENTICATED", 0) >= 1 and r["codes"].get("INVALID_ARGUMENT", 0) > 100
    assert r["codes"].get("RESOURCE_EXHAUSTED", 0) >= 1  # the 10 MB message


def test_cancels_and_deadlines_free_every_slot(stack, ref):
    r = probes.probe_cancels(stack, ref, n=1000)
    assert not any(r["after"].values())


def test_paused_triton_ends_requests_within_the_bound(stack):
    r = probes.probe_paused_triton(stack, BOUND_S)
    assert r["ended_after_s"] < BOUND_S + 5


def test_killed_triton_stub_is_seen_and_repaired(stack, ref):
    r = probes.probe_stub_killed(stack, ref)
    assert r["triton_restarts"] >= 1


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
