"""The limits (flashmap.types: MAX_DRAFT_STEPS, the plain-tokens cap, max_draft_tokens >= 0) are
checked in one place and refused with the same message at every entry point.

Here: the checks themselves, the services' configs, `flashmap generate --in-process` and the
drafter's edge (Draft stream, SetSteps, `flashmap steps`) on a drafter service in this process.
gRPC Generate and the OpenAI API are checked on test_stack.py's running stack
(TestMainStack.test_limits_at_the_public_apis), which imports the cases from here."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import grpc
import numpy as np
import pytest

from flashmap.types import (
    DRAFT_STEPS,
    MAX_DRAFT_STEPS,
    MAX_PLAIN_TOKENS,
    PLAIN_TOKENS,
    GenerationRequest,
    InvalidRequest,
    check_draft_steps,
    check_max_draft_tokens,
)

# (value, the message it is refused with; None: accepted)
DRAFT_STEPS_CASES = [
    (0, f"draft_steps must be in 1..{MAX_DRAFT_STEPS}, got 0"),
    (
        MAX_DRAFT_STEPS + 1,
        f"draft_steps must be in 1..{MAX_DRAFT_STEPS}, got {MAX_DRAFT_STEPS + 1}",
    ),
    (1, None),
    (2, None),
]
MAX_DRAFT_TOKENS_CASES = [
    (-1, "max_draft_tokens must be >= 0 (0 = speculation off), got -1"),
    (0, None),
    (3, None),
]


def test_one_check_per_limit():
    for value, message in DRAFT_STEPS_CASES + [(-3, "got -3"), (2.5, "got 2.5")]:
        if message is None:
            assert check_draft_steps(value) == value
            GenerationRequest([1, 2], 4, draft_steps=value).validate(100, 64)
            continue
        with pytest.raises(InvalidRequest, match=message):
            check_draft_steps(value)
        with pytest.raises(InvalidRequest, match=message):
            GenerationRequest([1, 2], 4, draft_steps=value).validate(100, 64)
    for value, message in MAX_DRAFT_TOKENS_CASES:
        if message is None:
            GenerationRequest([1, 2], 4, max_draft_tokens=value).validate(100, 64)
            assert check_max_draft_tokens(value) == value
            continue
        with pytest.raises(InvalidRequest, match=message.replace("(", r"\(").replace(")", r"\)")):
            GenerationRequest([1, 2], 4, max_draft_tokens=value).validate(100, 64)
    assert 1 <= DRAFT_STEPS <= MAX_DRAFT_STEPS and 1 <= PLAIN_TOKENS <= MAX_PLAIN_TOKENS


def test_service_configs_check_their_options_with_the_same_limits(monkeypatch, tmp_path):
    from drafter_service.service_config import DrafterServiceConfig
    from flashmap.config import from_env, parse, to_argv
    from flashmap_cli.stack import StackConfig
    from orchestrator.config import OrchestratorConfig

    for value, message in DRAFT_STEPS_CASES:
        if message is None:
            assert DrafterServiceConfig(target_dir="t", steps=value).steps == value
            continue
        with pytest.raises(ValueError, match=f"--steps: {message}"):
            DrafterServiceConfig(target_dir="t", steps=value)
        with pytest.raises(ValueError, match=f"--steps: {message}"):
            StackConfig(target_dir="t", steps=value, log_dir=str(tmp_path))  # the drafter's
        monkeypatch.setenv("FLASHMAP_DRAFT_STEPS", str(value))
        with pytest.raises(SystemExit):  # a usage error, from the environment as from a flag
            parse(DrafterServiceConfig, ["--target-dir", "t"])
        monkeypatch.delenv("FLASHMAP_DRAFT_STEPS")
    for bad in (0, MAX_PLAIN_TOKENS + 1):
        with pytest.raises(ValueError, match=f"--plain-tokens: must be in 1..{MAX_PLAIN_TOKENS}"):
            OrchestratorConfig(plain_tokens=bad)
    # The defaults live in the parts; a stack passes its choices as flags, the rest as the part
    # would read them from the environment.
    assert StackConfig.plain_tokens == OrchestratorConfig.plain_tokens == PLAIN_TOKENS
    assert StackConfig.steps == DrafterServiceConfig.steps == DRAFT_STEPS
    monkeypatch.setenv("FLASHMAP_PLAIN_TOKENS", "5")
    cfg = StackConfig(target_dir="t", plain_tokens=7, log_dir=str(tmp_path))
    assert "--plain-tokens=7" in to_argv(cfg.orchestrator_config())
    assert from_env(OrchestratorConfig).plain_tokens == 5
    # to_argv and parse are each other's inverse (the secrets travel in the environment)
    no_secrets = dict(api_key="", target_key="", drafter_token="")
    back = parse(OrchestratorConfig, to_argv(cfg.orchestrator_config()))
    assert replace(back, **no_secrets) == replace(cfg.orchestrator_config(), **no_secrets)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from target_service.random_checkpoint import make_random_qwen3

    return make_random_qwen3(tmp_path_factory.mktemp("limits") / "target", vocab_size=300)


def test_flashmap_generate_in_process(target, capsys):
    from flashmap_cli.main import main

    base = ["generate", "--in-process", "--target", str(target), "--prompt-ids", "1,2,3"]
    base += ["--max-new-tokens", "4", "--ar", "--json"]
    for flag, cases in (
        ("--draft-steps", DRAFT_STEPS_CASES),
        ("--max-draft-tokens", MAX_DRAFT_TOKENS_CASES),
    ):
        for value, message in cases:
            code = main([*base, flag, str(value)])
            err = capsys.readouterr().err
            if message is None:
                assert code == 0, err
            else:
                assert code == 2 and err == f"error: {message}\n", err


class _DrafterInThread:
    """The drafter service (drafter_service.server) around an oracle, served from a thread."""

    def __init__(self, token: str):
        from drafter_service.oracle import OracleProposer
        from drafter_service.server import DrafterService, serve
        from flashmap.grpc_serving import free_port

        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.ready, self.stop = asyncio.Event(), None
        proposer = OracleProposer([[1, 2, 3, 4] * 8], block_size=4, vocab_size=16, feature_dim=2)

        async def main():
            self.stop = asyncio.Event()
            await serve(
                DrafterService(proposer, name="oracle", available_steps=tuple(range(1, 65))),
                "127.0.0.1",
                self.port,
                0,
                ready=self.ready,
                stop=self.stop,
                token=token,
                probe_interval_s=0,
            )

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(main(),))
        self.thread.start()

    def close(self):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)


def test_the_drafter_edge(monkeypatch, capsys):
    """SetSteps, a Draft stream's sequence and `flashmap steps` refuse what the request path
    refuses, with its message; the unset fields (proto3 optional) take the drafter's own."""
    from flashmap.auth import DRAFTER_TOKEN_ENV, DRAFTER_TOKEN_HEADER
    from flashmap.client import DrafterAdmin, InvalidArgument
    from flashmap.grpc_serving import wait_grpc_health
    from flashmap.v1 import drafter_pb2, drafter_pb2_grpc
    from flashmap.wire import features_to_tensor
    from flashmap_cli.main import main

    monkeypatch.setenv(DRAFTER_TOKEN_ENV, "t0ken")
    d = _DrafterInThread("t0ken")
    url = f"127.0.0.1:{d.port}"
    try:
        wait_grpc_health(url, 30)
        admin = DrafterAdmin(url)
        stub = drafter_pb2_grpc.DrafterStub(grpc.insecure_channel(url))
        md = ((DRAFTER_TOKEN_HEADER, "t0ken"),)

        def draft(**fields) -> drafter_pb2.Block:
            seq = drafter_pb2.SequenceDraft(
                seq_id="s",
                context_start=0,
                new_token_ids=[1, 2],
                new_features=features_to_tensor(np.zeros((2, 2), np.float32)),
                anchor=3,
                **fields,
            )
            req = drafter_pb2.DraftRequest(call_id=1, sequences=[seq])
            (resp,) = list(stub.Draft(iter([req]), timeout=30, metadata=md))
            stub.Release(drafter_pb2.ReleaseRequest(seq_ids=["s"]), timeout=30, metadata=md)
            return resp.blocks[0]

        for value, message in DRAFT_STEPS_CASES:
            if message is None:
                assert admin.set_steps(value) == value
                assert main(["steps", "--drafter-url", url, str(value)]) == 0
                assert capsys.readouterr().out == f"{value}\n"
                block = draft(draft_steps=value)
                assert not block.error and block.draft_steps == value
                continue
            with pytest.raises(InvalidArgument, match=message):
                admin.set_steps(value)
            assert main(["steps", "--drafter-url", url, str(value)]) == 2
            assert message in capsys.readouterr().err
            assert draft(draft_steps=value).error == message
        admin.set_steps(2)
        block = draft()  # unset: the drafter's step count, the whole block
        assert block.draft_steps == 2 and len(block.tokens) == 4
        assert len(draft(max_draft_tokens=1).tokens) == 1  # the one place drafts are cut
        assert len(draft(max_draft_tokens=0).tokens) == 0
        admin.close()
    finally:
        d.close()
