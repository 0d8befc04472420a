"""Where a verify call through Triton goes, against the same engine in one process.

    python -m bench.triton_overhead [--target DIR] [--blocks 5] [--calls 60] [--rows 1] \\
        [--decode-steps 1] [--draft 0]
    python -m bench.triton_overhead --requests 32 [--max-new-tokens 48] [--block 1] [--decode-steps 16]

Starts Triton alone (no drafter, no orchestrator) and a TargetEngine in this process, then
alternates call by call: the local `TargetEngine.verify` of `rows` sequences, then the same
rows through Triton (one packed request per call). The VM's speed drifts by a third within
minutes, and blocks of calls alternated still leave a block's drift in each ratio; alternated
call by call, both sides see the same machine. A call is either a plain decode step of
`decode-steps` tokens per row (VerifyRow.next_seeds), or with `--draft K` a drafted verify:
every row carries K random draft tokens after its last token and asks for features, as a
drafted round at concurrency 1 does (the draft is rejected, so a row starts one position later
each call). Both sides must decode the same tokens (checked every call).

Per block of `calls` pairs, means in ms (Triton's metrics give the model's run only as a sum,
and means add up): the local verify, the client's call and the model's run of a batch inside
Triton (`flashmap_target_batch_run_seconds_total` over `flashmap_target_verify_batches_total`:
the stub's parse, verify and answer); then the ratio of the model's run to the local verify and
what the call adds to the model's run (messages, Triton's server, the hand-over to the stub).

With `--requests N`: whole requests at concurrency 1 instead of single calls: the target alone
in process (`flashmap.inprocess.decode`) and the round loop calling Triton as the orchestrator
does (`bench.bench_stack.triton_alone`: `--decode-steps` tokens a call, by default the orchestrator's,
the next call queued while one runs),
on random-id prompts, the same tokens on both sides (checked). The sides alternate every
`--block` requests. Per side, means per request: the wall time, its compute (the local engine's
verify calls; the stub's runs of its verify batches, from Triton's metrics) and the rest (for Triton:
its prompt's round trip, the last answer's way back, the release), the first request of a
block (which runs after the other side: its caches are the other side's) against the others,
and the compute split into the computing thread's CPU time and the rest (time it waited
inside the calls: for Python's lock, for Triton's server to take an answer, for its CPU).
With `--block 1` every request is a first one.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np
import torch

from bench.bench_stack import inprocess_run, prompt_sets, triton_alone
from flashmap.cpus import on_cpus
from flashmap.metrics import scrape, totals
from flashmap.types import SamplingParams, VerifyRow
from flashmap_cli.stack import Stack, StackConfig, default_checkpoints
from orchestrator.target_client import TargetClient
from target_service.engine import TargetEngine

PROMPT = np.arange(3, 23)


class Rows:
    """One side's sequences: the next call's rows, moved on by each call's answers."""

    def __init__(
        self, slots: list[int], first_tokens: list[int], draft: int, decode_steps: int, seed: int
    ):
        self.slots, self.last, self.pos = slots, first_tokens, len(PROMPT)
        self.draft, self.steps = draft, decode_steps
        self.rng = np.random.default_rng(seed)

    def next(self) -> list[VerifyRow]:
        params = SamplingParams()
        if self.draft:
            out = []
            for s, t in zip(self.slots, self.last):
                d = self.rng.integers(3, 500, size=self.draft)  # [K]
                out.append(
                    VerifyRow(
                        s, self.pos, np.concatenate([[t], d]), params, support_ids=d[:, None].copy()
                    )
                )
            return out
        more = np.zeros(self.steps - 1, np.int64)  # greedy: the further steps' seeds are unused
        return [
            VerifyRow(s, self.pos, np.array([t]), params, next_seeds=more, features=False)
            for s, t in zip(self.slots, self.last)
        ]

    def advance(self, results) -> None:
        if (
            self.draft
        ):  # a random draft is rejected: the row's own token is committed, then the target's
            self.pos += 1
            self.last = [int(r.argmax[0]) for r in results]
        else:
            self.pos += self.steps
            self.last = [int(r.argmax[-1]) for r in results]


async def _measure(
    cfg: StackConfig,
    engine: TargetEngine,
    blocks: int,
    calls: int,
    rows: int,
    decode_steps: int,
    draft: int,
    cpus: tuple[set[int], set[int]] | None = None,
) -> dict[str, list]:
    client = TargetClient(f"{cfg.host}:{cfg.triton_grpc_port}", key=cfg.target_key)
    metrics = f"http://{cfg.host}:{cfg.triton_metrics_port}/metrics"
    params, ids = SamplingParams(), list(range(1000, 1000 + rows))
    first = await client.verify_rows(
        [(i, VerifyRow(i, 0, PROMPT, params), [], True, False) for i in ids]
    )
    slots = [engine.allocate() for _ in ids]
    local_first = engine.verify([VerifyRow(s, 0, PROMPT, params) for s in slots])
    remote = Rows(ids, [int(r[0].argmax[-1]) for r in first], draft, decode_steps, seed=1)
    local = Rows(slots, [int(r.argmax[-1]) for r in local_first], draft, decode_steps, seed=1)
    out: dict[str, list] = {"local verify": [], "Triton call": [], "Triton model": []}
    for _ in range(blocks):
        before, local_s, call_s = _settled_totals(metrics), [], []
        for _ in range(calls):
            batch = local.next()
            with on_cpus(
                cpus and cpus[0]
            ):  # the model's cores, as in Triton; the client on the rest
                t0 = time.perf_counter()
                mine = engine.verify(batch)
                local_s.append(time.perf_counter() - t0)
            local.advance(mine)
            batch = remote.next()
            t0 = time.perf_counter()
            res = await client.verify_rows([(i, r, [], False, False) for i, r in zip(ids, batch)])
            call_s.append(time.perf_counter() - t0)
            for r, m in zip(res, mine):
                if isinstance(r, BaseException):
                    raise r
                if not np.array_equal(
                    r[0].argmax, m.argmax
                ):  # the same work on both sides, or no comparison
                    raise AssertionError("Triton and the local engine decoded different tokens")
            remote.advance([r[0] for r in res])
        after = _settled_totals(metrics)
        n = (
            after["flashmap_target_verify_batches_total"]
            - before["flashmap_target_verify_batches_total"]
        )  # not the health probes
        out["local verify"].append(np.mean(local_s))
        out["Triton call"].append(np.mean(call_s))
        out["Triton model"].append(
            (
                after["flashmap_target_batch_run_seconds_total"]
                - before["flashmap_target_batch_run_seconds_total"]
            )
            / n
        )
    return out


def whole_requests(target: str, n: int, max_new: int, block: int, decode_steps: int) -> None:
    """`n` requests per side in blocks of `block` requests, the sides alternating block by block
    (in process first in every other pair of blocks). Per side: the requests' wall time, split
    into compute (the local engine's verify calls; the stub's verify batches, from Triton's metrics)
    and the rest, and the first request of a block (after the other side ran) against the others."""
    cfg = StackConfig.on_free_ports(
        target_dir=target,
        drafter="init",
        n_slots=1,
        max_seq_len=512,
        with_drafter=False,
        decode_steps=decode_steps,
    )
    engine = TargetEngine(target, n_slots=1, max_seq_len=512)
    metrics = f"http://{cfg.host}:{cfg.triton_metrics_port}/metrics"
    prompts = prompt_sets(target, engine.vocab_size, n)["random ids"]
    local_verify = engine.verify
    verify_s: list[float] = []
    verify_cpu_s: list[float] = []

    def timed_verify(rows):
        t0, c0 = time.perf_counter(), time.thread_time()
        out = local_verify(rows)
        verify_s.append(time.perf_counter() - t0)
        verify_cpu_s.append(time.thread_time() - c0)
        return out

    engine.verify = timed_verify
    wall = {"in process": [], "Triton": []}  # per request, in order within each block
    compute = {"in process": 0.0, "Triton": 0.0}
    on_cpu = {"in process": 0.0, "Triton": 0.0}  # of compute

    with Stack(cfg) as stack:
        cpus = stack.cpus or (None, None)
        triton_alone(cfg, prompts[:1], 8, 1)  # warm both sides
        inprocess_run(engine, None, prompts[:1], 8, 1, cfg.decode_steps)
        info_s = asyncio.run(_info_cost(cfg, metrics))
        for b, i in enumerate(range(0, n, block)):
            part, outputs = prompts[i : i + block], {}
            for side in ("in process", "Triton") if b % 2 == 0 else ("Triton", "in process"):
                run_before, cpu_before = _stub_run_and_cpu_s(metrics, info_s)
                verify_s.clear()
                verify_cpu_s.clear()
                outputs[side] = []
                for p in part:
                    with on_cpus(cpus[side == "Triton"]):  # each side computes on the model's cores
                        r = (
                            inprocess_run(engine, None, [p], max_new, 1, cfg.decode_steps)
                            if side == "in process"
                            else triton_alone(cfg, [p], max_new, 1)
                        )
                    outputs[side] += r["outputs"]
                    wall[side].append(r["seconds"])
                if side == "in process":
                    compute[side] += sum(verify_s)
                    on_cpu[side] += sum(verify_cpu_s)
                else:
                    run_after, cpu_after = _stub_run_and_cpu_s(metrics, info_s)
                    compute[side] += run_after - run_before
                    on_cpu[side] += cpu_after - cpu_before
            if outputs["in process"] != outputs["Triton"]:
                raise AssertionError("Triton and the local engine decoded different tokens")
    local, remote = np.array(wall["in process"]), np.array(wall["Triton"])
    first = np.arange(len(local)) % block == 0
    print(
        f"{n} requests of {max_new} new tokens per side at concurrency 1, {cfg.decode_steps} tokens a call, "
        f"alternated in blocks of {block}; tokens/s through Triton / in process: {local.sum() / remote.sum():.3f} "
        f"(per request: median {np.median(local / remote):.3f}, quartiles {np.quantile(local / remote, 0.25):.3f}-"
        f"{np.quantile(local / remote, 0.75):.3f})"
    )
    print(
        "ms per request (means)   wall  compute  rest   first of a block  the others   compute on CPU  off CPU"
    )
    for side, w in wall.items():
        w = np.array(w)
        others = f"{w[~first].mean() * 1e3:10.1f}" if (~first).any() else f"{'-':>10s}"
        print(
            f"  {side:20s} {w.mean() * 1e3:6.1f} {compute[side] / n * 1e3:8.1f} {(w.sum() - compute[side]) / n * 1e3:5.1f}"
            f" {w[first].mean() * 1e3:17.1f} {others} {on_cpu[side] / n * 1e3:16.1f} "
            f"{(compute[side] - on_cpu[side]) / n * 1e3:8.1f}"
        )
    print(
        "compute: the local engine's verify calls; in Triton the stub's runs of its verify batches (parse, verify, "
        f"answer; an INFO batch, {info_s * 1e3:.2f} ms, taken off for every other batch); on CPU: the computing "
        "thread's CPU time in it (in Triton, flashmap_target_batch_cpu_seconds_total, every batch). "
        f"Stub / local compute: {compute['Triton'] / compute['in process']:.3f}; on CPU: "
        f"{on_cpu['Triton'] / on_cpu['in process']:.3f}"
    )


def _settled_totals(metrics: str) -> dict[str, float]:
    """Triton's metrics once the model has sent what it recorded (it sends them between batches,
    within 0.25 s of the last)."""
    time.sleep(0.5)
    return totals(scrape(metrics, 10))


def _stub_run_and_cpu_s(metrics: str, info_s: float) -> tuple[float, float]:
    """Seconds the stub has run verify batches: all its runs less the other batches (INFO probes,
    releases) at `info_s`, what an INFO batch costs; and the worker's CPU seconds in all its runs."""
    m = _settled_totals(metrics)
    other = m["flashmap_target_batches_total"] - m["flashmap_target_verify_batches_total"]
    return m["flashmap_target_batch_run_seconds_total"] - other * info_s, m[
        "flashmap_target_batch_cpu_seconds_total"
    ]


async def _info_cost(cfg: StackConfig, metrics: str, n: int = 40) -> float:
    """Seconds the stub runs one INFO batch (the orchestrator's health probe, a client's first call)."""
    client = TargetClient(f"{cfg.host}:{cfg.triton_grpc_port}", key=cfg.target_key)
    before = _settled_totals(metrics)
    for _ in range(n):
        await client.info(refresh=True)
    after = _settled_totals(metrics)
    await client.close()
    return (
        after["flashmap_target_batch_run_seconds_total"]
        - before["flashmap_target_batch_run_seconds_total"]
    ) / (after["flashmap_target_batches_total"] - before["flashmap_target_batches_total"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", default=None)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--calls", type=int, default=60, help="alternated pairs of calls per block")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument(
        "--decode-steps",
        type=int,
        default=None,
        help="tokens per row in one plain call (default 1; with --requests, the orchestrator's default)",
    )
    ap.add_argument(
        "--draft", type=int, default=0, help="K > 0: drafted verifies of K draft tokens per row"
    )
    ap.add_argument(
        "--requests",
        type=int,
        default=0,
        help="N > 0: N whole requests alternated instead of calls",
    )
    ap.add_argument("--max-new-tokens", type=int, default=48, help="with --requests")
    ap.add_argument(
        "--block",
        type=int,
        default=1,
        help="with --requests: requests per side before the other side runs",
    )
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    target, _, _ = default_checkpoints(a.target, "init")
    if a.requests:
        steps = StackConfig.decode_steps if a.decode_steps is None else a.decode_steps
        whole_requests(target, a.requests, a.max_new_tokens, a.block, steps)
        return 0
    if a.decode_steps is None:
        a.decode_steps = 1
    advance = 1 if a.draft else a.decode_steps
    max_seq_len = len(PROMPT) + a.blocks * a.calls * advance + a.draft + a.decode_steps + 8
    cfg = StackConfig.on_free_ports(
        target_dir=target,
        drafter="init",
        n_slots=a.rows,
        max_seq_len=max_seq_len,
        with_drafter=False,
    )
    engine = TargetEngine(target, n_slots=a.rows, max_seq_len=max_seq_len)
    with Stack(cfg) as stack:
        with on_cpus(stack.cpus and stack.cpus[1]):
            out = asyncio.run(
                _measure(
                    cfg, engine, a.blocks, a.calls, a.rows, a.decode_steps, a.draft, stack.cpus
                )
            )
    what = (
        f"1 + {a.draft} tokens (drafted, with features)"
        if a.draft
        else f"{a.decode_steps} token(s), no features"
    )
    print(
        f"{a.rows} row(s) of {what} per call, {a.calls} pairs of calls per block alternated call by call, means in ms:"
    )
    for name, v in out.items():
        print(f"  {name:13s} " + " ".join(f"{x * 1e3:6.2f}" for x in v))
    model, local = np.array(out["Triton model"]), np.array(out["local verify"])
    print(
        "  model / local "
        + " ".join(f"{x:6.2f}" for x in model / local)
        + f"   (median {np.median(model / local):.2f})"
    )
    extra = np.array(out["Triton call"]) - model
    print(
        "  call - model  "
        + " ".join(f"{x * 1e3:6.2f}" for x in extra)
        + f"   (median {np.median(extra) * 1e3:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
