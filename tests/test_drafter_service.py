"""The drafter service process serves saved checkpoints (FlashMap, DFlash-style, EAGLE-style):
`python -m drafter_service.server --drafter DIR` answers the bidirectional Draft stream with
the same blocks as the in-process proposer loaded from the same directory."""

import os
import subprocess
import sys

import grpc
import numpy as np
import pytest

from drafter_service.checkpoint import init_drafter, save_drafter
from drafter_service.eagle import init_eagle, save_eagle
from drafter_service.factory import load_proposer
from flashmap.drafts import ProposeRequest
from flashmap.grpc_serving import free_port, wait_grpc_health
from flashmap.v1 import drafter_pb2, drafter_pb2_grpc
from flashmap.wire import answer_from_proto, features_to_tensor
from target_service.random_checkpoint import make_random_qwen3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_random_qwen3(tmp_path_factory.mktemp("svc") / "target", with_tokenizer=False)


def _save(kind, target, path):
    if kind == "eagle":
        return save_eagle(init_eagle(target, seed=0), path)
    return save_drafter(
        init_drafter(target, seed=0, kind=kind, dim=64, n_blocks=1, n_heads=4), path
    )


# float16 features (a target whose FEATURES are TYPE_FP16) travel as float16 and draft what
# the same values in float32 draft.
@pytest.mark.parametrize(
    "kind,dtype", [("flashmap", np.float32), ("dflash", np.float16), ("eagle", np.float16)]
)
def test_service_serves_saved_checkpoint(kind, dtype, target, tmp_path):
    ckpt = _save(kind, target, tmp_path / kind)
    port = free_port()
    log = tmp_path / "drafter.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "drafter_service.server",
            "--target-dir",
            str(target),
            "--drafter",
            str(ckpt),
            "--port",
            str(port),
            "--metrics-port",
            "0",
            "--device",
            "cpu",
        ],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        wait_grpc_health(f"127.0.0.1:{port}", 120, proc, log)
        rng = np.random.default_rng(0)
        ids, feats = rng.integers(0, 512, 9), rng.standard_normal((9, 64)).astype(dtype)
        sent = features_to_tensor(feats)
        assert sent.dtype == np.dtype(dtype).name and len(sent.data) == feats.nbytes
        seq = drafter_pb2.SequenceDraft(
            seq_id="a",
            context_start=0,
            new_token_ids=ids.tolist(),
            new_features=sent,
            anchor=5,
            seed=3,
        )
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = drafter_pb2_grpc.DrafterStub(ch)
            (resp,) = list(
                stub.Draft(iter([drafter_pb2.DraftRequest(call_id=7, sequences=[seq])]), timeout=60)
            )
            stats = stub.Stats(drafter_pb2.StatsRequest(), timeout=10)
        assert resp.call_id == 7 and not resp.blocks[0].error, resp.blocks[0].error
        local = load_proposer(str(ckpt), str(target), n_slots=1, max_context=64)
        local.extend("a", ids, feats.astype(np.float32))
        (expect,) = local.propose([ProposeRequest("a", anchor=5, seed=3)], local.steps)
        np.testing.assert_array_equal(
            answer_from_proto(resp.blocks[0]).drafts[0].tokens, expect.tokens
        )
        assert stats.active_sequences == 1 and stats.context_tokens == 9
    finally:
        proc.terminate()
        proc.wait(30)
