"""The paths bench.stack times, each over a chunk of prompts `concurrency` at a time.

- "target": the target alone in this process, batched (flashmap.inprocess.decode);
- "spec": fixed-K speculation in this process (the same, with a drafter);
- "triton": the target alone through Triton: the round loop calls Triton directly, no
  orchestrator, no drafter, each round sent ahead as the orchestrator sends it;
- "off", "full", "auto": through the stack (Triton + drafter + orchestrator) with speculation
  off (max_draft_tokens = 0 per request on the auto orchestrator), the full block every round
  (a second orchestrator with --speculation full) and the goodput controller.

Every path returns {"outputs", "seconds"}; the Triton and stack paths also "busy_s", the
target model's forwards within the run (from its metrics), and the stack's the services'
metric deltas, from which `stack_summary` makes the per-round split.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from itertools import zip_longest

import numpy as np
import uvloop

from flashmap.client import AsyncClient
from flashmap.cpus import on_cpus
from flashmap.inprocess import decode
from flashmap.metrics import scrape, totals
from flashmap.pipeline import pipelined_round
from flashmap.prompts import TEST_PROMPTS, read_domain_prompts
from flashmap.sequence import Sequence
from flashmap.types import GenerationRequest
from flashmap_cli.stack import StackConfig
from orchestrator.target_client import TargetClient, TritonTarget

MODES = ("target", "spec", "triton", "off", "full", "auto")
IN_PROCESS = ("target", "spec")
STACK_MODES = ("off", "full", "auto")

# The target model's worker, per batch: its run and, within the run, the answers it handed to Triton.
RUN, ANSWER = (
    "flashmap_target_batch_run_seconds_total",
    "flashmap_target_batch_answer_seconds_total",
)
# The controller's expected and realised accepted draft tokens, kept apart by `scrape_all`.
CALIBRATION = "flashmap_controller_accepted_tokens_total"


def prompt_sets(target: str, vocab: int, n: int) -> dict[str, list[list[int]]]:
    """n random-id prompts, and n prompts of the demo domains from the test split taken from each
    domain in turn (the file lists one domain after another; repeated as needed; absent for a
    target without a tokenizer)."""
    rng = np.random.default_rng(0)
    sets = {
        "random ids": [
            rng.integers(3, vocab, size=int(rng.integers(8, 32))).tolist() for _ in range(n)
        ]
    }
    try:
        by_domain: dict[str, list] = {}
        for p in read_domain_prompts(TEST_PROMPTS, target):
            by_domain.setdefault(p["domain"], []).append(p["ids"])
        text = [x for turn in zip_longest(*by_domain.values()) for x in turn if x is not None]
        sets["test-prompt text"] = [text[i % len(text)] for i in range(n)]
    except (OSError, ValueError):  # a target without a tokenizer
        pass
    return sets


def chunks_of(prompts: list, concurrency: int, n: int) -> list[list]:
    """The prompts in about `n` consecutive chunks, each a whole number of batches of
    `concurrency` (fewer chunks when there are not enough batches)."""
    batches = -(-len(prompts) // concurrency)
    per = -(-batches // max(1, min(n, batches))) * concurrency
    return [prompts[i : i + per] for i in range(0, len(prompts), per)]


def tok_s(run: dict) -> float:
    return sum(len(o) for o in run["outputs"]) / run["seconds"]


def inprocess_run(engine, proposer, prompts, max_new, concurrency, plain_tokens: int = 1) -> dict:
    """The target (with `proposer`: fixed-K speculation) in this process."""
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), concurrency):
        outs += decode(
            engine,
            [GenerationRequest(p, max_new) for p in prompts[i : i + concurrency]],
            proposer,
            plain_tokens=plain_tokens,
        )
    return {"outputs": [o.token_ids for o in outs], "seconds": time.perf_counter() - t0}


def engine_seconds(delta: dict[str, float]) -> float:
    """The target model's forwards over a run (metric deltas): its batches' run seconds less the
    answers' hand-over. Each forward starts after its request was sent and ends before its
    answer goes out, so it lies within the client's clock; the hand-over does not (the client
    can read the last answer before the worker's send returns), and it is part of what the
    path adds. The wall less this is what a path adds to the model."""
    return delta.get(RUN, 0.0) - delta.get(ANSWER, 0.0)


def scrape_all(cfg: StackConfig) -> dict[str, float]:
    """Totals of the orchestrator's, the drafter's and Triton's metrics (names do not collide)."""
    out: dict[str, float] = {}
    for port in (cfg.metrics_port, cfg.drafter_metrics_port, cfg.triton_metrics_port):
        samples = scrape(f"http://{cfg.host}:{port}/metrics", 10)
        out.update(totals(samples))
        for name, labels, value in samples:  # expected and accepted apart
            if name == CALIBRATION:
                out[f"{name}:{labels['kind']}"] = out.get(f"{name}:{labels['kind']}", 0.0) + value
    return out


def since(before: dict[str, float], cfg: StackConfig) -> dict[str, float]:
    """The metrics' change since `before`, once the run's last batch is counted: the target
    model sends its metrics between batches, within 0.25 s of the last."""
    time.sleep(0.5)
    after = scrape_all(cfg)
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def triton_alone(cfg: StackConfig, prompts, max_new, concurrency) -> dict:
    """The target alone through Triton: the round loop calls Triton directly, `concurrency`
    sequences at a time, each round sent ahead as the orchestrator sends it (cfg.pipeline).
    The ceiling of the stack with speculation off."""

    async def run():
        target = TritonTarget(
            TargetClient(f"{cfg.host}:{cfg.triton_grpc_port}", key=cfg.target_key), cfg.max_seq_len
        )
        await target.client.info()  # connected before the clock starts, as the stack's client is
        outs, base = [], random.getrandbits(40) + 1
        t0 = time.perf_counter()
        for i in range(0, len(prompts), concurrency):
            seqs = [
                Sequence(str(base + i + j), GenerationRequest(p, max_new), handle=base + i + j)
                for j, p in enumerate(prompts[i : i + concurrency])
            ]
            ahead = None
            while live := [s for s in seqs if not s.finished]:
                res = await pipelined_round(
                    live, target, plain_tokens=cfg.plain_tokens, ahead=ahead, send=cfg.pipeline
                )
                ahead = res.ahead
            for s in seqs:
                await target.release(s.handle)
            outs += [s.generated for s in seqs]
        seconds = time.perf_counter() - t0
        await target.client.close()
        return {"outputs": outs, "seconds": seconds}

    before = scrape_all(cfg)
    out = asyncio.run(run())
    return {**out, "busy_s": engine_seconds(since(before, cfg))}


def through_stack(cfg: StackConfig, prompts, max_new, concurrency, spec_off: bool = False) -> dict:
    """The prompts through the stack, `concurrency` streams at a time; also "delta" (the
    services' metrics over the run) and the streams' "drafts", "accepted" and "fallback"."""
    before = scrape_all(cfg)

    # One asyncio client for every stream, as a load generator holds one: it sends a burst in a
    # few ms and reads the streams in one thread, where a thread per stream competed with the
    # services for the CPU.
    async def run():
        async with AsyncClient(cfg.url, api_key=cfg.api_key) as client:
            await client.health()
            slots = asyncio.Semaphore(concurrency)

            async def one(p):
                async with slots:
                    return await client.generate(
                        prompt_ids=p,
                        max_new_tokens=max_new,
                        ignore_eos=True,
                        max_draft_tokens=0 if spec_off else None,
                    )

            t0 = time.perf_counter()
            outs = await asyncio.gather(*map(one, prompts))
            return outs, time.perf_counter() - t0

    outs, dt = uvloop.run(run())
    delta = since(before, cfg)
    return {
        "outputs": [o.token_ids for o in outs],
        "seconds": dt,
        "busy_s": engine_seconds(delta),
        "delta": delta,
        "drafts": sum(o.stats.drafts for o in outs),
        "accepted": sum(o.stats.accepted for o in outs),
        "fallback": sum(o.stats.fallback_rounds for o in outs),
    }


def joined(parts: list[dict]) -> dict:
    """Runs over consecutive chunks of the prompts as one run: outputs, seconds, tokens/s, and
    busy_s where every part has it."""
    run = {
        "outputs": [o for p in parts for o in p["outputs"]],
        "seconds": sum(p["seconds"] for p in parts),
    }
    if all("busy_s" in p for p in parts):
        run["busy_s"] = sum(p["busy_s"] for p in parts)
    return {**run, "tok_s": tok_s(run)}


def stack_summary(parts: list[dict]) -> dict:
    """Runs of `through_stack` (the chunks of one repeat) as one: tokens/s, acceptance, the
    per-round split and the controller's decisions."""
    d: dict[str, float] = {}
    for p in parts:
        for k, v in p["delta"].items():
            d[k] = d.get(k, 0.0) + v
    drafts = sum(p["drafts"] for p in parts)
    rounds = max(d.get("flashmap_round_latency_seconds_count", 0.0), 1.0)
    batches = max(d.get("flashmap_target_batches_total", 0.0), 1.0)  # one per verify forward
    per_round = lambda name: 1e3 * d.get(name, 0.0) / rounds  # noqa: E731
    per_batch = lambda name: 1e3 * d.get(name, 0.0) / batches  # noqa: E731
    return {
        **joined(parts),
        "gamma": 1 + sum(p["accepted"] for p in parts) / drafts if drafts else 1.0,
        "draft_ms": per_round("flashmap_draft_latency_seconds_sum"),
        "verify_ms": per_round("flashmap_verify_latency_seconds_sum"),
        "round_ms": per_round("flashmap_round_latency_seconds_sum"),
        # Inside the parts: the drafter's forward per round; per batch the target model ran, its
        # wait behind the batch before it and its run (engine and answers; flashmap_target_batch_*).
        "drafter_forward_ms": per_round("flashmap_drafter_forward_latency_seconds_sum"),
        "triton_queue_ms": per_batch("flashmap_target_batch_wait_seconds_total"),
        "triton_compute_ms": per_batch(RUN),
        "triton_answer_ms": per_batch(ANSWER),
        "triton_cpu_ms": per_batch("flashmap_target_batch_cpu_seconds_total"),
        "mean_draft_len": d.get("flashmap_draft_length_sum", 0.0)
        / max(d.get("flashmap_draft_length_count", 0.0), 1),
        "off_rounds": d.get("flashmap_speculation_off_rounds_total", 0.0),
        "rounds": rounds,
        "fallback": sum(p["fallback"] for p in parts),
        "shadow_probes": d.get("flashmap_shadow_probes_total", 0.0),
        "expected_accepted": d.get(f"{CALIBRATION}:expected", 0.0),
        "controller_accepted": d.get(f"{CALIBRATION}:accepted", 0.0),
    }


@dataclass
class Paths:
    """What the paths run on: the in-process engine and drafter, the auto and the full
    orchestrators' configs (one Triton and one drafter under both) and the stack's CPU split."""

    engine: object
    proposer: object
    auto: StackConfig
    full: StackConfig
    cpus: tuple[set[int], set[int]] | None


def run_mode(mode: str, part, max_new: int, concurrency: int, ctx: Paths) -> dict:
    """One chunk of prompts through one of MODES. The in-process runs compute on the target
    model's CPUs, the clients of Triton and of the stack on the rest (Stack.cpus), so each
    side computes on the same cores."""
    if mode in IN_PROCESS:
        with on_cpus(ctx.cpus and ctx.cpus[0]):
            proposer = ctx.proposer if mode == "spec" else None
            return inprocess_run(
                ctx.engine, proposer, part, max_new, concurrency, ctx.auto.plain_tokens
            )
    with on_cpus(ctx.cpus and ctx.cpus[1]):
        if mode == "triton":
            return triton_alone(ctx.auto, part, max_new, concurrency)
        cfg = ctx.full if mode == "full" else ctx.auto
        return through_stack(cfg, part, max_new, concurrency, spec_off=mode == "off")
