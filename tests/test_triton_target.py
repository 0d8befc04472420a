"""The Triton-hosted target against a REAL tritonserver (the binary nvidia-pytriton ships).

One server per module (tiny random Qwen3, 8 KV slots, 3 s idle timeout) on free loopback
ports. Checks: results equal the in-process TargetEngine (prefill, greedy and sampled
rounds, a rollback); concurrent sequences share execute() calls; END and release() free
slots; the idle timeout frees slots; bad requests get clear errors and the server keeps
serving. The launcher's config rewriting is checked without a server.

Skipped when no tritonserver is available (e.g. the 'triton' extra is not installed).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from flashmap.grpc_serving import free_ports
from flashmap.types import InvalidRequest, SamplingParams, VerifyRow
from target_service import launcher

N_SLOTS = 8
IDLE_S = 3.0
MAX_SEQ_LEN = 200  # not the checkpoint default (256): checks the setting reaches the model
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from target_service.random_checkpoint import make_random_qwen3

    return make_random_qwen3(
        tmp_path_factory.mktemp("target") / "qwen3", max_position_embeddings=256
    )


def _start(checkpoint, log: Path, **kw):
    """A tritonserver with the target model on free loopback ports (CPU, float32); the test
    skips where no tritonserver is installed."""
    try:
        launcher.find_tritonserver()
    except launcher.TritonStartError as e:
        pytest.skip(str(e))
    grpc_port, http_port, metrics_port = free_ports(3)
    return launcher.start_triton(
        checkpoint,
        grpc_port=grpc_port,
        http_port=http_port,
        metrics_port=metrics_port,
        max_seq_len=MAX_SEQ_LEN,
        device="cpu",
        dtype="float32",
        log_path=log,
        ready_timeout_s=180,
        **kw,
    )


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    handle = _start(checkpoint, log, n_slots=N_SLOTS, idle_timeout_s=IDLE_S)
    yield handle
    code = handle.stop()
    assert code == 0, f"tritonserver exit code {code}:\n{launcher.log_tail(log)}"


@pytest.fixture(scope="module")
def engine(checkpoint):
    import torch

    from target_service.engine import TargetEngine

    return TargetEngine(
        checkpoint, n_slots=4, max_seq_len=MAX_SEQ_LEN, device="cpu", dtype=torch.float32
    )


def run(coro_fn, server, **kw):
    """Run an async test body with a fresh client (gRPC aio channels belong to one loop)."""
    from orchestrator.target_client import TargetClient

    async def main():
        async with TargetClient(server.grpc_url, **kw) as client:
            return await coro_fn(client)

    return asyncio.run(main())


def metric(server, name: str) -> float:
    """Sum of a metric's samples in Triton's /metrics (ours carry a model label)."""
    total = 0.0
    for line in server.metrics().splitlines():
        m = re.match(rf"{name}(?:\{{[^}}]*\}})? (\S+)$", line)
        if m:
            total += float(m.group(1))
    return total


def at_rest(server, name: str) -> float:
    """A metric's value once what the model recorded has been sent (it sends between batches,
    within about 0.25 s of a change): two reads 0.4 s apart that agree. For a baseline that
    the earlier tests' last counts must not arrive after."""
    deadline, value = time.monotonic() + 20, metric(server, name)
    while True:
        time.sleep(0.4)
        now = metric(server, name)
        if now == value or time.monotonic() > deadline:
            return now
        value = now


def active(server) -> float:
    return metric(server, "flashmap_target_active_sequences")


def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def settled(server, name: str, want: float, timeout_s: float = 20.0) -> None:
    """The model sends its metrics between batches, about 0.25 s after a change (longer on a
    loaded host): wait for it. A failure carries the server log's tail."""
    try:
        wait_for(lambda: metric(server, name) == want, timeout_s, f"{name} == {want}")
    except AssertionError as e:
        raise AssertionError(f"{e} (now {metric(server, name)})\n{server.log_tail()}") from None


def settled_active(server, want: int) -> None:
    settled(server, "flashmap_target_active_sequences", want)


# --------------------------------------------------------------------------- no server


@pytest.mark.unit
def test_write_model_repository_sets_serving_values(tmp_path):
    from target_service.target_config import TargetModelConfig
    from target_service.triton_repository import write_model_repository

    model = TargetModelConfig(
        model_dir=str(tmp_path), max_seq_len=99, dtype="float32", feature_layers="1,2"
    )
    repo = write_model_repository(
        tmp_path / "repo",
        n_slots=3,
        idle_timeout_s=1.5,
        max_queue_delay_us=250,
        features_dtype="float16",
        model=model,
    )
    cfg = (repo / "flashmap_target" / "config.pbtxt").read_text()
    assert re.search(r"max_batch_size: 3\b", cfg) and re.search(
        r"max_candidate_sequences: 3\b", cfg
    )
    assert "max_sequence_idle_microseconds: 1500000" in cfg
    assert "max_queue_delay_microseconds: 250" in cfg
    assert re.search(r'name: "FEATURES"\s+data_type: TYPE_FP16', cfg)
    assert (repo / "flashmap_target" / "1" / "model.py").is_file()
    # The model's settings: the ones given, as one JSON parameter, read back as Triton hands
    # them to the model (the config as JSON, the parameter's string unescaped).
    from google.protobuf import json_format, text_format

    model_config = json_format.MessageToDict(
        text_format.Parse(cfg, _model_config_class()()), preserving_proto_field_name=True
    )
    assert TargetModelConfig.from_triton(model_config, env={}) == model
    assert json.loads(model_config["parameters"]["target_model_config"]["string_value"]) == {
        "model_dir": str(tmp_path.resolve()),
        "max_seq_len": 99,
        "dtype": "float32",
        "feature_layers": "1,2",
    }


def _model_config_class():
    """Triton's ModelConfig message, enough of it to parse config.pbtxt (the fields this
    repository's config uses)."""
    pytest.importorskip("tritonclient.grpc")
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2.ModelConfig


def test_the_model_reads_settings_the_json_leaves_out_from_the_environment():
    """The launcher's JSON first, then each setting's variable, then the defaults; a bad value
    names its variable."""
    from target_service.target_config import TargetModelConfig

    def params(d):
        return {"parameters": {"target_model_config": {"string_value": json.dumps(d)}}}

    env = {"FLASHMAP_TARGET_DEVICE": "cpu", "FLASHMAP_TARGET_DIR": "/env/dir"}
    got = TargetModelConfig.from_triton(params({"model_dir": "/json/dir"}), env)
    assert (got.model_dir, got.device, got.dtype, got.cuda_graphs) == (
        "/json/dir",
        "cpu",
        "auto",
        "auto",
    )
    assert TargetModelConfig.from_triton({}, env).model_dir == "/env/dir"  # a bare tritonserver
    with pytest.raises(ValueError, match=r"\$FLASHMAP_TARGET_CPUS: must be a CPU list"):
        TargetModelConfig.from_triton({}, {"FLASHMAP_TARGET_CPUS": "3-1"})
    with pytest.raises(ValueError, match="unknown settings"):
        TargetModelConfig.from_triton(params({"devise": "cpu"}), {})
    with pytest.raises(ValueError, match="no checkpoint; set \\$FLASHMAP_TARGET_DIR"):
        TargetModelConfig.from_triton({}, {}).checkpoint()
    auto = TargetModelConfig()
    assert (auto.device_for(True), auto.device_for(False)) == ("cuda", "cpu")
    assert (auto.dtype_for("cuda:1"), auto.dtype_for("cpu")) == ("bfloat16", "float32")
    assert (auto.graphs_for("cuda"), auto.graphs_for("cpu")) == (True, False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        TargetModelConfig(cuda_graphs="true").graphs_for("cpu")
    with pytest.raises(ValueError, match="needs drafter_dir"):
        TargetModelConfig(context_projection="true")


@pytest.mark.unit
def test_side_channel_sends_what_is_due_and_keeps_what_a_failed_call_did_not_send():
    """Metric updates and log lines are IPC calls to the server, recorded anywhere and sent by
    the worker: the first record wakes it, nothing goes out before it is due (`wait_s` says
    when), and a call that raises leaves what it did not send for the next flush (a counter
    never loses increments, the newest gauge value wins, logs keep their order)."""
    import types

    from target_service.side_channel import SideChannel

    logged = []
    logger = types.SimpleNamespace(
        log_info=lambda m: logged.append(("info", m)),
        log_error=lambda m: logged.append(("error", m)),
    )

    class Metric:
        def __init__(self, fail: int = 0):
            self.value, self.fail = 0.0, fail

        def increment(self, n):
            if self.fail:
                self.fail -= 1
                raise RuntimeError("IPC failed")
            self.value += n

        def set(self, v):
            self.value = v

    rows, gauge, wakes = Metric(fail=1), Metric(), []
    side = SideChannel(
        {"rows": rows, "gauge": gauge}, logger, interval_s=3600, wake=lambda: wakes.append(1)
    )
    assert side.wait_s() is None
    side.inc("rows", 5)
    side.set("gauge", 2)
    side.log("info", "first")
    assert len(wakes) == 1 and 3590 < side.wait_s() <= 3600
    side.flush()  # not due: nothing goes out
    assert rows.value == gauge.value == 0 and not logged
    side._due = time.monotonic()  # due now
    with pytest.raises(RuntimeError):
        side.flush()
    assert rows.value == 0 and logged == [("info", "first")] and side.wait_s() is not None
    side.inc("rows", 3)
    side.set("gauge", 7)
    side.log("error", "second")
    side._due = time.monotonic()  # due now
    assert side.wait_s() == 0
    side.flush()
    assert (rows.value, gauge.value) == (8, 7) and logged == [
        ("info", "first"),
        ("error", "second"),
    ]
    assert side.wait_s() is None and len(wakes) == 2


@pytest.mark.unit
def test_sequence_slots_admit_only_what_continues_a_sequence(engine):
    """The model's bookkeeping without a server: START takes a slot, a row must start inside
    what its sequence's last row left, a continuation row is fed the token the last row
    without drafts decoded, END frees the slot, unknown and idle sequences are refused."""
    import types

    from flashmap.types import FOLLOW_TOKEN
    from target_service.sequence_slots import SequenceSlots

    seqs = SequenceSlots(engine, 60.0, types.SimpleNamespace(inc=print, log=print))
    greedy = SamplingParams(temperature=0.0)
    row = VerifyRow(-1, 0, np.array([5, 6, 7]), greedy)
    assert seqs.admit(7, True, False, row, 0.0) is None and row.slot == seqs.slots[7]
    result = engine.verify([row])[0]
    seqs.verified(7, row, ("ok", result, 0))
    with pytest.raises(InvalidRequest, match="START_POS"):
        seqs.admit(7, False, False, VerifyRow(-1, 2, np.array([1]), greedy), 1.0)
    follow = VerifyRow(-1, 3, np.array([FOLLOW_TOKEN]), greedy)
    assert seqs.admit(7, False, False, follow, 1.0) is None
    assert follow.tokens.tolist() == [int(result.decoded(True)[-1])]
    assert seqs.admit(7, False, True, None, 2.0) == ("released",) and len(seqs) == 0
    for corrid, start in ((7, False), (8, False)):
        with pytest.raises(InvalidRequest, match="unknown sequence"):
            seqs.admit(corrid, start, False, VerifyRow(-1, 0, np.array([1]), greedy), 3.0)
    assert seqs.admit(9, True, False, VerifyRow(-1, 0, np.array([1]), greedy), 3.0) is None
    assert seqs.reap_idle(3.0 + 61.0) == [9] and engine.free_slots == engine.n_slots


# --------------------------------------------------------------------------- server


def test_info_matches_engine(server, engine, checkpoint):
    info = run(lambda c: c.info(), server)
    assert info.model_name == checkpoint.name and info.triton_model == "flashmap_target"
    assert info.vocab_size == engine.vocab_size
    assert info.feature_layers == engine.feature_layers
    assert info.feature_dim == engine.feature_dim
    assert info.max_seq_len == engine.max_seq_len
    assert info.eos_token_ids == engine.eos_token_ids
    assert (
        info.n_slots == N_SLOTS
        and info.idle_timeout_s == IDLE_S
        and info.max_seq_len == MAX_SEQ_LEN
    )
    assert info.hidden_size == engine.hidden_size and info.num_layers == engine.num_layers
    assert (
        info.packed_verify == engine.packed_verify
    )  # the controller prices verifies as the engine runs them
    assert info.extra["cuda_graphs"] is False  # CPU: eager


def _script(engine, rng):
    """Rows for two sequences (prefill + 3 rounds each) and the in-process results.

    Computed before touching the server so the Triton calls run back to back (the idle
    timeout is short). Round 2 rolls back (start_pos before the end of the cache), round 3
    samples at T > 0 with a support of 2 and top-k / top-p. Sequence 2's last rounds ask for
    no features; sequence 1's rows ask for log-probabilities (the top 3 from round 2 on).
    """
    sampled = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)
    slots = {1: engine.allocate(), 2: engine.allocate()}
    prompts = {1: rng.integers(3, 500, 11), 2: rng.integers(3, 500, 6)}
    rounds, expected = [], []
    rows = {s: VerifyRow(slots[s], 0, prompts[s], GREEDY) for s in slots}  # prefill
    length = {s: len(prompts[s]) for s in slots}
    for r in range(4):
        results = engine.verify(list(rows.values()))
        rounds.append(rows)
        expected.append(dict(zip(rows, results)))
        nxt = {}
        for s, res in zip(rows, results):
            anchor = int(res.argmax[-1])
            start = length[s] - (2 if r == 1 else 0)  # round 2: drop the last two tokens
            if r < 2:
                drafts = np.array([int(res.argmax[-1]), *rng.integers(3, 500, 2)])
                support = drafts[:, None]
                params, seed = GREEDY, 0
            else:
                drafts = rng.integers(3, 500, 3)
                support = np.stack([drafts, rng.integers(3, 500, 3)], 1)
                support[1, 1] = -1
                params, seed = sampled, 1000 + s
            tokens = np.concatenate([[anchor], drafts])
            nxt[s] = VerifyRow(
                slots[s],
                start,
                tokens,
                params,
                support_ids=support,
                round_seed=seed,
                features=not (s == 2 and r >= 2),
                logprobs=(0 if r == 0 else 3) if s == 1 else -1,
            )  # NO_FEATURES: a sequence that never drafts
            length[s] = start + len(tokens)
        rows = nxt
    for s in slots.values():
        engine.release(s)
    return rounds, expected


def test_results_equal_inprocess_engine(server, engine):
    rounds, expected = _script(engine, np.random.default_rng(1))

    async def body(c):
        got = []
        try:
            for i, rows in enumerate(rounds):
                res = await asyncio.gather(
                    *[c.verify(s, row, start=(i == 0)) for s, row in rows.items()]
                )
                got.append(dict(zip(rows, res)))
        finally:
            await asyncio.gather(*[c.release(s) for s in rounds[0]])
        return got

    got = run(body, server)
    _assert_same_results(expected, got)
    _assert_sampled(got)
    assert got[-1][2].features.shape[0] == 0 < got[-1][1].features.shape[0]
    settled_active(server, 0)


def _assert_same_results(expected, got, features_dtype=np.float32):
    for i, (exp_round, got_round) in enumerate(zip(expected, got)):
        for s, exp in exp_round.items():
            g, where = got_round[s], f"round {i} seq {s}"
            np.testing.assert_array_equal(g.argmax, exp.argmax, err_msg=where)
            np.testing.assert_array_equal(g.residual, exp.residual, err_msg=where)
            assert g.support_probs.shape == exp.support_probs.shape, where
            np.testing.assert_allclose(
                g.support_probs, exp.support_probs, rtol=1e-4, atol=1e-6, err_msg=where
            )
            np.testing.assert_allclose(
                g.complement, exp.complement, rtol=1e-4, atol=1e-6, err_msg=where
            )
            assert g.features.dtype == features_dtype and g.features.shape == exp.features.shape, (
                where
            )
            tol = 1e-4 if features_dtype == np.float32 else 2e-3  # float16: 11 bits of mantissa
            np.testing.assert_allclose(
                g.features.astype(np.float32), exp.features, rtol=tol, atol=tol, err_msg=where
            )
            assert g.logprobs.shape == exp.logprobs.shape, where
            assert g.top_ids.shape == exp.top_ids.shape, where
            np.testing.assert_allclose(g.logprobs, exp.logprobs, atol=1e-4, err_msg=where)
            np.testing.assert_array_equal(g.top_ids, exp.top_ids, err_msg=where)
            np.testing.assert_allclose(g.top_logprobs, exp.top_logprobs, atol=1e-4, err_msg=where)


def _assert_sampled(got):
    """_script's sampled round really sampled something (not the T=0 placeholders); sequence 1
    got its log-probabilities, sequence 2 none."""
    last = got[-1][1]
    assert last.support_probs.shape == (3, 2) and (last.residual >= 0).any()
    assert last.logprobs.shape == (4, 3) and last.top_ids.shape == (4, 3)
    assert got[1][1].logprobs.shape == (4, 2) and got[1][1].top_ids.shape == (4, 0)
    assert got[-1][2].logprobs.shape == (0, 0)


def test_packed_rounds_equal_inprocess_engine_one_forward_each(server, engine):
    """A round as one packed request: the same results as the engine, one forward per round,
    a bad row refused alone, releases in the same form."""
    rounds, expected = _script(engine, np.random.default_rng(1))
    before = at_rest(server, "flashmap_target_verify_batches_total")

    async def body(c):
        got = []
        for i, rows in enumerate(rounds):
            items = [(s, row, i == 0, False) for s, row in rows.items()]
            if i == 2:  # a row for a sequence never started, and one past its sequence's end
                bad = replace(rows[1], start_pos=rows[1].start_pos + 5)
                items += [(999, rows[1], False, False), (1, bad, False, False)]
            out = await c.verify_rows(items)
            if i == 2:
                assert isinstance(out[2], InvalidRequest) and "unknown sequence" in str(out[2])
                assert isinstance(out[3], InvalidRequest) and "START_POS" in str(out[3])
                out = out[:2]
            got.append({s: res for s, (res, _path) in zip(rows, out)})
        settled_active(server, 2)
        released = await c.verify_rows(
            [(s, None, False, True) for s in rounds[0]] + [(999, None, False, True)]
        )
        assert released[:2] == [None, None] and isinstance(released[2], InvalidRequest)
        return got

    got = run(body, server)
    _assert_same_results(expected, got)
    _assert_sampled(got)
    settled(server, "flashmap_target_verify_batches_total", before + len(rounds))
    settled_active(server, 0)


def test_multi_step_rows_equal_the_engine_and_continue_where_they_end(server, engine):
    """A row with NEXT_SEEDS (greedy prompt + 3 steps beside a sampled decode row + 2) gives
    what the engine gives; the sequence then continues at its last decoded token only."""
    rng = np.random.default_rng(3)
    sampled = SamplingParams(temperature=0.9, top_k=30)
    prompts = {21: rng.integers(3, 500, 9), 22: rng.integers(3, 500, 5)}
    first = {
        21: VerifyRow(
            -1, 0, prompts[21], GREEDY, round_seed=4, next_seeds=np.array([5, 6, 7]), logprobs=2
        ),
        22: VerifyRow(-1, 0, prompts[22], sampled, round_seed=8),
    }
    before = at_rest(server, "flashmap_target_verify_rows_total")
    slots = {s: engine.allocate() for s in prompts}
    exp1 = engine.verify([replace(r, slot=slots[s]) for s, r in first.items()])
    second = {
        21: VerifyRow(-1, 12, exp1[0].argmax[-1:], GREEDY),
        22: VerifyRow(
            -1, 5, exp1[1].residual[-1:], sampled, round_seed=9, next_seeds=np.array([10, 11])
        ),
    }
    exp2 = engine.verify([replace(r, slot=slots[s]) for s, r in second.items()])
    for s in slots.values():
        engine.release(s)

    async def body(c):
        got1 = await c.verify_rows([(s, r, True, False) for s, r in first.items()])
        bad = await c.verify_rows([(21, replace(second[21], start_pos=11), False, False)])
        got2 = await c.verify_rows([(s, r, False, True) for s, r in second.items()])
        return got1, bad, got2

    got1, bad, got2 = run(body, server)
    assert isinstance(bad[0], InvalidRequest) and "START_POS" in str(bad[0])
    _assert_same_results(
        [dict(zip(first, exp1)), dict(zip(second, exp2))],
        [
            {s: res for s, (res, _) in zip(first, got1)},
            {s: res for s, (res, _) in zip(second, got2)},
        ],
    )
    assert len(got1[0][0].argmax) == 4 and len(got2[1][0].residual) == 3
    assert got1[0][0].top_ids.shape == (4, 2)  # one row of log-probabilities per step
    settled_active(server, 0)
    settled(
        server, "flashmap_target_verify_rows_total", before + 4
    )  # a row, however many steps, counts once


def test_continuation_rows_follow_the_last_decoded_token_in_order(server, engine):
    """TOKENS [FOLLOW_TOKEN]: fed the last token the sequence's previous row without drafts
    decoded. A continuation in the same packed request as the row it follows (and a release
    after both) runs after it, one forward each; the results equal the engine fed the real
    tokens. A continuation after a drafted row, or at another position, is refused with
    FOLLOW_REFUSED and changes nothing."""
    from flashmap.types import FOLLOW_REFUSED, FOLLOW_TOKEN

    sampled = SamplingParams(temperature=0.9, top_k=30)
    prompt = np.arange(3, 12)
    first = VerifyRow(-1, 0, prompt, sampled, round_seed=3, next_seeds=np.array([4, 5]))
    follow = VerifyRow(
        -1, 11, np.array([FOLLOW_TOKEN]), sampled, round_seed=6, next_seeds=np.array([7])
    )
    slot = engine.allocate()
    exp1 = engine.verify([replace(first, slot=slot)])[0]
    exp2 = engine.verify([replace(follow, slot=slot, tokens=exp1.residual[-1:])])[0]
    exp3 = engine.verify(
        [
            VerifyRow(
                slot, 13, np.array([int(exp2.residual[-1]), 7]), GREEDY, support_ids=np.array([[7]])
            )
        ]
    )[0]
    engine.release(slot)
    batches = at_rest(server, "flashmap_target_verify_batches_total")

    async def body(c):
        got = await c.verify_rows([(41, first, True, False), (41, follow, False, False)])
        drafted = VerifyRow(
            -1, 13, np.array([int(got[1][0].residual[-1]), 7]), GREEDY, support_ids=np.array([[7]])
        )
        third = await c.verify_rows([(41, drafted, False, False)])
        refused = await c.verify_rows(
            [
                (41, replace(follow, start_pos=15), False, False),
                (42, replace(follow, start_pos=0), True, False),
            ]
        )
        released = await c.verify_rows([(41, None, False, True)])
        return got, third, refused, released

    got, third, refused, released = run(body, server)
    _assert_same_results(
        [{1: exp1, 2: exp2, 3: exp3}], [{1: got[0][0], 2: got[1][0], 3: third[0][0]}]
    )
    assert all(
        isinstance(r, InvalidRequest) and str(r).startswith(FOLLOW_REFUSED) for r in refused
    ), refused
    assert released == [None]
    settled(
        server, "flashmap_target_verify_batches_total", batches + 3
    )  # the row, its continuation, the drafted row
    settled_active(server, 0)


def test_pipelined_rounds_give_the_text_of_one_token_rounds(server, engine):
    """The round loop over TritonTarget sending each round without drafts ahead (the next one
    queued while it runs): greedy, seeded sampling and a stop token that ends a request while
    its next round is in flight give the text of one-token rounds in process. When the round
    ahead overtakes the one it follows (here: that one held back 50 ms), the target refuses
    the continuation and the loop sends it again with its token."""
    from flashmap.inprocess import decode
    from flashmap.pipeline import pipelined_round
    from flashmap.sequence import Sequence
    from flashmap.types import FOLLOW_REFUSED, GenerationRequest
    from orchestrator.target_client import TritonTarget

    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 500, n).tolist() for n in (6, 9, 4)]
    greedy_text = decode(engine, [GenerationRequest(prompts[2], 30)])[0].token_ids
    requests = lambda: [
        GenerationRequest(prompts[0], 13),  # noqa: E731
        GenerationRequest(prompts[1], 20, SamplingParams(temperature=0.9, top_k=50, seed=11)),
        GenerationRequest(prompts[2], 30, stop_token_ids=(greedy_text[9],)),
    ]
    expected = [r.token_ids for r in decode(engine, requests())]
    assert len(expected[2]) < 30  # the stop token ended it

    def overtaken(c):
        """The client's first request (the prompts' round, which sends the next one ahead) held
        back, so the round sent ahead of it arrives first."""
        send, calls = c.verify_rows, []

        async def verify_rows(items, timeout_s=None):
            calls.append(1)
            if len(calls) == 1:
                await asyncio.sleep(0.05)
            out = await send(items, timeout_s)
            refused.extend(
                o
                for o in out
                if isinstance(o, InvalidRequest) and str(o).startswith(FOLLOW_REFUSED)
            )
            return out

        c.verify_rows = verify_rows
        return c

    async def body(c, wrap):
        target = TritonTarget(wrap(c), MAX_SEQ_LEN)
        seqs = [Sequence(str(500 + i), r, handle=500 + i) for i, r in enumerate(requests())]
        ahead, sent = None, 0
        while live := [s for s in seqs if not s.finished]:
            if ahead is not None and all(s.finished for s in ahead.seqs):
                ahead = None
            res = await pipelined_round(live, target, plain_tokens=4, ahead=ahead, send=True)
            ahead, sent = res.ahead, sent + (res.ahead is not None)
            assert all(r.error is None for r in res.sequences), res.sequences
        for s in seqs:
            await target.release(s.handle)
        return [s.generated for s in seqs], sent

    refused = []
    for wrap in (lambda c: c, overtaken):
        got, sent = run(lambda c: body(c, wrap), server)
        assert got == expected
        assert sent >= 4
    # The three continuations that came first, each sent again; on a loaded host two calls in
    # flight may reach Triton in either order, and a later round is refused (and resent) too.
    assert len(refused) >= 3
    settled_active(server, 0)


def test_float16_features_come_back_as_float16(checkpoint, engine, tmp_path):
    """A server whose FEATURES are TYPE_FP16 (launcher --features-dtype float16): packed rounds
    give the engine's results with the features in float16, which the client keeps (the
    drafter casts them)."""
    handle = _start(checkpoint, tmp_path / "tritonserver.log", n_slots=2, features_dtype="float16")
    try:
        rounds, expected = _script(engine, np.random.default_rng(4))

        async def body(c):
            got = []
            for i, rows in enumerate(rounds):
                out = await c.verify_rows(
                    [(s, row, i == 0, i == len(rounds) - 1) for s, row in rows.items()]
                )
                got.append({s: res for s, (res, _path) in zip(rows, out)})
            return got

        _assert_same_results(expected, run(body, handle), features_dtype=np.float16)
    finally:
        assert handle.stop() == 0, launcher.log_tail(tmp_path / "tritonserver.log")


async def _generated(orch, prompt, max_new: int) -> list[int]:
    """The tokens an in-process Orchestrator streams for a greedy request of `prompt`."""
    from flashmap.request_options import Prompt, RequestOptions
    from orchestrator.requests import Piece

    gen = orch.make_request(
        Prompt(token_ids=prompt), RequestOptions(max_new_tokens=max_new, ignore_eos=True)
    )
    return [
        t
        for item in [x async for x in orch.stream(gen)]
        if isinstance(item, Piece)
        for t in item.token_ids
    ]


def test_a_lone_prompt_sends_its_first_decode_ahead_and_a_burst_does_not(server, engine):
    """The orchestrator's scheduler. A request that reaches the idle scheduler alone (one client
    at a time) sends its first decode round ahead, behind its prompt: the target does not idle
    while the prompt's answer travels back. Requests that arrive while that prompt runs (held
    here until two more are queued) prefill in the next call, then every sequence decodes in one
    call per round. Two requests sent together (a burst, gathered by the burst gate) send
    nothing ahead of their prompts: a sequence that arrives meanwhile would otherwise wait behind
    a round of the others. The text is the target alone's either way."""
    from flashmap.inprocess import decode
    from flashmap.types import GenerationRequest
    from orchestrator.server import Orchestrator, OrchestratorConfig

    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 500, n).tolist() for n in (7, 5, 9)]
    expected = [r.token_ids for r in decode(engine, [GenerationRequest(p, 10) for p in prompts])]

    async def serve(first: int, later: int, sent_before: int):
        orch = Orchestrator(
            OrchestratorConfig(
                target_url=server.grpc_url, drafter_url="", metrics_port=0, plain_tokens=4
            )
        )
        await orch.start()
        calls, gate, send = [], asyncio.Event(), orch.target.verify_rows

        async def verify_rows(
            items, timeout_s=None
        ):  # the first call's answer is held until the gate opens
            calls.append([(corrid, row.steps) for corrid, row, *_ in items])
            held = len(calls) == 1
            answer = await send(items, timeout_s)
            if held:
                await gate.wait()
            return answer

        orch.target.verify_rows = verify_rows

        def generate(prompt):
            return _generated(orch, prompt, 10)

        try:
            tasks = [asyncio.create_task(generate(p)) for p in prompts[:first]]
            while len(calls) < sent_before:
                await asyncio.sleep(0.01)
            tasks += [asyncio.create_task(generate(p)) for p in prompts[first : first + later]]
            while len(orch.waiting) < later:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # anything else the scheduler would send before the answer
            sent_before_answer = len(calls)
            gate.set()
            return await asyncio.gather(*tasks), calls, sent_before_answer
        finally:
            await orch.stop()

    texts, calls, sent = asyncio.run(serve(1, 2, 2))
    assert texts == expected
    assert sent == 2, calls  # the prompt, and behind it the first decode round
    ((first, _),) = calls[0]
    assert calls[1] == [(first, 4)]
    assert len(calls[2]) == 2 and first not in {
        c for c, _ in calls[2]
    }  # the late prompts, on their own
    assert all(len(c) == 3 for c in calls[3:5]), calls  # then one call for all three

    texts, calls, sent = asyncio.run(serve(2, 0, 1))
    assert texts == expected[:2]
    assert sent == 1 and len(calls[0]) == 2, calls  # both prompts in one call, nothing behind it
    settled_active(server, 0)


def test_requests_sent_together_start_in_one_round(server, engine):
    """Burst admission (orchestrator.admission): two requests reach the idle scheduler
    together and a third comes 30 ms later, within the gap: the scheduler waits for it and all
    three prompts go to the target in the first call. The next request to find the scheduler
    idle comes alone, but the traffic since the last start came in a burst, so it waits a gap
    for company and sends no decode behind its prompt; the one after it, with nothing close
    together since, starts at once and does. The text is the target alone's."""
    from flashmap.inprocess import decode
    from flashmap.types import GenerationRequest
    from orchestrator.server import Orchestrator, OrchestratorConfig

    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 500, n).tolist() for n in (6, 8, 4, 5, 7)]
    expected = [r.token_ids for r in decode(engine, [GenerationRequest(p, 6) for p in prompts])]

    async def serve():
        orch = Orchestrator(
            OrchestratorConfig(
                target_url=server.grpc_url,
                drafter_url="",
                metrics_port=0,
                burst_window_s=2.0,
                burst_gap_s=0.25,
            )
        )
        await orch.start()
        calls, send = [], orch.target.verify_rows

        async def verify_rows(items, timeout_s=None):
            calls.append(len(items))
            return await send(items, timeout_s)

        orch.target.verify_rows = verify_rows

        def generate(prompt):
            return _generated(orch, prompt, 6)

        try:
            burst = [asyncio.create_task(generate(p)) for p in prompts[:2]]
            await asyncio.sleep(0.03)
            burst.append(asyncio.create_task(generate(prompts[2])))
            texts = await asyncio.gather(*burst)
            first_call = calls[0]
            await asyncio.sleep(0.3)  # the gap passes: the next request is not part of a burst

            def wait_s():
                return orch.metrics.registry.get_sample_value(
                    "flashmap_burst_wait_seconds_sum", {"model": orch.info.model_name}
                )

            def ahead():
                return orch.metrics.registry.get_sample_value(
                    "flashmap_rounds_ahead_total", {"model": orch.info.model_name}
                )

            waited, sent_ahead = [wait_s()], []
            for p in prompts[3:]:
                before = ahead()
                texts.append(await generate(p))
                waited.append(wait_s() - sum(waited))
                sent_ahead.append(ahead() - before)
            return texts, first_call, waited, sent_ahead
        finally:
            await orch.stop()

    texts, first_call, waited, sent_ahead = asyncio.run(serve())
    assert texts == expected
    assert first_call == 3  # the three prompts in one call
    assert 0.25 <= waited[0] < 2.0  # until a gap passed after the third
    assert 0.25 <= waited[1] < 0.5  # alone after a burst: one gap
    assert waited[2] == 0  # alone after one alone: no wait
    # A start that waited for a burst sends no decode behind its prompt (the rest of a late
    # burst would prefill behind it); a lone request of lone traffic does.
    assert sent_ahead == [0, 1], sent_ahead
    settled_active(server, 0)


def test_concurrent_sequences_share_forward_passes(server):
    rng = np.random.default_rng(2)
    before = {
        n: at_rest(server, n)
        for n in (
            "flashmap_target_verify_batches_total",
            "flashmap_target_verify_rows_total",
            "nv_inference_exec_count",
            "nv_inference_count",
            "flashmap_target_batch_run_seconds_total",
            "flashmap_target_batch_answer_seconds_total",
            "flashmap_target_batch_cpu_seconds_total",
        )
    }
    seqs = list(range(101, 101 + N_SLOTS))
    n_rounds = 3

    async def body(c):
        prompts = {s: rng.integers(3, 500, int(rng.integers(4, 20))) for s in seqs}
        res = await asyncio.gather(
            *[c.verify(s, VerifyRow(-1, 0, prompts[s], GREEDY), start=True) for s in seqs]
        )
        lengths = {s: len(prompts[s]) for s in seqs}
        anchors = {s: int(r.argmax[-1]) for s, r in zip(seqs, res)}
        try:
            settled_active(server, N_SLOTS)
            for _ in range(n_rounds):
                rows = {}
                for s in seqs:
                    k = int(rng.integers(0, 5))  # ragged: different K (and L) per sequence
                    drafts = rng.integers(3, 500, k)
                    rows[s] = VerifyRow(
                        -1,
                        lengths[s],
                        np.concatenate([[anchors[s]], drafts]),
                        GREEDY,
                        support_ids=drafts[:, None],
                    )
                out = await asyncio.gather(*[c.verify(s, rows[s], start=False) for s in seqs])
                for s, r in zip(seqs, out):
                    assert r.argmax.shape == (rows[s].num_draft + 1,)
                    assert r.features.shape[0] == len(rows[s].tokens)
                    lengths[s] += len(rows[s].tokens)
                    anchors[s] = int(r.argmax[-1])
        finally:
            await asyncio.gather(*[c.release(s) for s in seqs])

    run(body, server)
    n_requests = len(seqs) * (n_rounds + 1)
    settled(
        server,
        "flashmap_target_verify_rows_total",
        before["flashmap_target_verify_rows_total"] + n_requests,
    )
    delta = {n: at_rest(server, n) - v for n, v in before.items()}
    # Fewer forwards than requests: the sequence batcher put several sequences in one execute().
    assert delta["flashmap_target_verify_batches_total"] < n_requests, delta
    assert delta["nv_inference_exec_count"] < delta["nv_inference_count"], delta
    # Handing the answers to Triton is part of a batch's run, and takes some of it.
    assert (
        0
        < delta["flashmap_target_batch_answer_seconds_total"]
        < delta["flashmap_target_batch_run_seconds_total"]
    ), delta
    # The worker's CPU time in its runs: some, and no more than the runs' wall time (one thread).
    assert (
        0
        < delta["flashmap_target_batch_cpu_seconds_total"]
        <= delta["flashmap_target_batch_run_seconds_total"]
    ), delta
    settled_active(server, 0)


def test_end_and_release_free_the_slot(server):
    async def body(c):
        await c.verify(201, VerifyRow(-1, 0, np.arange(3, 9), GREEDY), start=True)
        settled_active(server, 1)
        r = await c.verify(
            201,
            VerifyRow(-1, 6, np.array([5, 6]), GREEDY, support_ids=np.array([[6]])),
            start=False,
            end=True,
        )
        assert r.argmax.shape == (2,)
        settled_active(server, 0)
        await c.verify(202, VerifyRow(-1, 0, np.arange(3, 9), GREEDY), start=True)
        settled_active(server, 1)
        await c.release(202)  # cancel: END with no tokens
        settled_active(server, 0)
        await c.release(202)  # idempotent
        with pytest.raises(InvalidRequest, match="START"):
            await c.verify(202, VerifyRow(-1, 6, np.array([5]), GREEDY), start=False)

    run(body, server)


def test_a_sequences_last_round_frees_its_slot_without_a_release_call(server):
    """The round loop over TritonTarget: the verify that surely ends a sequence (max_new_tokens
    reached whatever the target answers) carries END, so the slot is free before release(),
    which then sends nothing. A row that fails with END keeps its slot for release()."""
    from flashmap.rounds import speculative_round
    from flashmap.sequence import Sequence
    from flashmap.types import GenerationRequest
    from orchestrator.target_client import TritonTarget

    async def body(c):
        target = TritonTarget(c, MAX_SEQ_LEN)
        seqs = [
            Sequence(str(301 + i), GenerationRequest(np.arange(3, 10 + i), n), handle=301 + i)
            for i, n in enumerate((1, 5, 12))
        ]
        while live := [s for s in seqs if not s.finished]:
            await speculative_round(live, target, plain_tokens=4)
        assert [len(s.generated) for s in seqs] == [1, 5, 12]
        settled_active(server, 0)
        calls = metric(server, "nv_inference_count")
        for s in seqs:
            await target.release(s.handle)
        assert metric(server, "nv_inference_count") == calls  # nothing left to free

        s = Sequence("310", GenerationRequest(np.arange(3, 9), 2), handle=310)
        await speculative_round([s], target)
        row = replace(s.verify_row(None), start_pos=99)  # past the sequence's end: refused
        (out,) = await target.verify([row], [True])
        assert isinstance(out, InvalidRequest)
        settled_active(server, 1)
        await target.release(310)
        settled_active(server, 0)

    run(body, server)


def test_idle_timeout_frees_the_slot(server):
    freed_before = at_rest(server, "flashmap_target_idle_released_total")

    async def body(c):
        await c.verify(301, VerifyRow(-1, 0, np.arange(3, 9), GREEDY), start=True)
        settled_active(server, 1)
        # No request arrives: the model's reaper thread must free the slot by itself.
        await asyncio.to_thread(
            wait_for, lambda: active(server) == 0, IDLE_S + 5, "the idle slot to be freed"
        )
        settled(server, "flashmap_target_idle_released_total", freed_before + 1)
        with pytest.raises(InvalidRequest, match="START"):
            await c.verify(301, VerifyRow(-1, 6, np.array([5]), GREEDY), start=False)

    run(body, server)


def test_bad_requests_get_clear_errors_and_server_keeps_serving(server):
    async def body(c):
        good = VerifyRow(-1, 0, np.arange(3, 9), GREEDY)
        bad = VerifyRow(-1, 0, np.array([3, 4, 100_000]), GREEDY)
        # Bad and good requests in flight together: only the bad one fails.
        results = await asyncio.gather(
            c.verify(401, good, start=True),
            c.verify(402, bad, start=True),
            c.verify(403, good, start=True),
            return_exceptions=True,
        )
        assert isinstance(results[1], InvalidRequest), results[1]
        assert "token id 100000 outside the vocabulary [0, 512)" in str(results[1])
        assert not isinstance(results[0], Exception) and not isinstance(results[2], Exception)
        np.testing.assert_array_equal(results[0].argmax, results[2].argmax)
        # A position the sequence did not commit is refused without saying what the slot holds.
        with pytest.raises(InvalidRequest, match="^START_POS does not continue this sequence$"):
            await c.verify(401, VerifyRow(-1, 50, np.array([3]), GREEDY), start=False)
        with pytest.raises(InvalidRequest, match="^START_POS does not continue this sequence$"):
            await c.verify(401, VerifyRow(-1, 2, np.array([3]), GREEDY), start=False)
        with pytest.raises(InvalidRequest, match="temperature"):
            await c.verify(
                401, VerifyRow(-1, 6, np.array([3]), SamplingParams(temperature=-1.0)), start=False
            )
        # Sequence 401 still works after its errors.
        r = await c.verify(401, VerifyRow(-1, 6, np.array([3]), GREEDY), start=False)
        assert r.features.shape == (1, (await c.info()).feature_dim)
        await asyncio.gather(*[c.release(s) for s in (401, 402, 403)])
        assert await c.ready()

    run(body, server)
    assert server.alive()
    settled_active(server, 0)


@pytest.mark.unit
def test_unreachable_server_is_target_unavailable():
    from orchestrator.target_client import TargetClient, TargetUnavailable

    async def body():
        async with TargetClient(f"127.0.0.1:{free_ports(1)[0]}") as c:
            assert not await c.ready()
            with pytest.raises(TargetUnavailable):
                await c.verify(1, VerifyRow(-1, 0, np.array([1]), GREEDY), start=True)

    asyncio.run(body())


def test_the_model_answers_on_its_grpc_stream_only(server):
    """The model is decoupled: Triton hands it the next batch while one computes, and it
    answers on the gRPC stream. The health probe (launcher.probe) is an INFO request there;
    unary infer is refused."""
    import tritonclient.grpc as tc
    from tritonclient.utils import InferenceServerException

    assert launcher.probe(server.grpc_url) == (True, "INFO answered")
    ok, detail = launcher.probe(f"127.0.0.1:{free_ports(1)[0]}", timeout_s=2)
    assert not ok and "UNAVAILABLE" in detail
    c = tc.InferenceServerClient(server.grpc_url)
    try:
        t = tc.InferInput("INFO", [1, 1], "BOOL")
        t.set_data_from_numpy(np.ones((1, 1), np.bool_))
        with pytest.raises(InferenceServerException, match="decoupled"):
            c.infer(
                "flashmap_target",
                [t],
                sequence_id=(1 << 62) + 5,
                sequence_start=True,
                sequence_end=True,
            )
    finally:
        c.close()


def test_a_timed_out_call_leaves_the_stream_to_the_next(server):
    """A call past its deadline raises TargetTimeout; its late answer is dropped, not taken for
    the next call's, and the stream serves on."""
    from orchestrator.target_client import TargetTimeout

    async def body(c):
        want = await c.info(refresh=True)
        row = VerifyRow(-1, 0, np.arange(3, 40), GREEDY)
        with pytest.raises(TargetTimeout):
            await c.verify_rows([(501, row, True, True)], timeout_s=1e-4)
        out = await asyncio.gather(
            *[c.info(refresh=True) for _ in range(3)], c.verify_rows([(502, row, True, True)])
        )
        assert out[:3] == [want] * 3
        ((res, _path),) = out[3]
        assert res.argmax.shape == (1,)

    run(body, server)
    settled_active(server, 0)


def test_a_bad_cpu_list_stops_the_model_with_a_clear_message(checkpoint, tmp_path):
    log = tmp_path / "tritonserver.log"
    with pytest.raises(launcher.TritonStartError) as e:
        _start(checkpoint, log, extra_env={"FLASHMAP_TARGET_CPUS": "3-1"})
    assert "must be a CPU list like 0-3,6" in str(e.value) + launcher.log_tail(log)
