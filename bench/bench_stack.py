"""Stack benchmark: the same prompts through the in-process decoder, the served stack, and the target alone.

For concurrency 1, 4 and 16: tokens/s, mean acceptance length, and the per-round split
(draft, verify, orchestration + transport) read from the orchestrator's Prometheus
histograms; then each service's peak memory and the per-sequence state of target and
drafter in bytes per context token. Greedy, fixed prompts; every stack output is
checked against the in-process autoregressive output.

  python -m bench.bench_stack [--target DIR] [--drafter DIR|init] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.bench_inprocess import machine
from drafter_service.factory import load_proposer
from flashmap.client import Client, DrafterAdmin
from flashmap.inprocess import decode
from flashmap.metrics import scrape, totals
from flashmap.types import GenerationRequest
from flashmap_cli.stack import Stack, StackConfig, default_checkpoints
from target_service.engine import TargetEngine

OUT = Path(__file__).resolve().parent.parent / "docs" / "results"


def scrape_sums(url: str) -> dict[str, float]:
    """Histogram _sum and _count totals by metric name (labels summed)."""
    return {k: v for k, v in totals(scrape(url, timeout=10)).items() if k.endswith(("_sum", "_count"))}


def peak_rss_mb(pid: int) -> float:
    """VmHWM of a process and all its descendants (Triton's Python stub is a child)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def inprocess(target, drafter, prompts, max_new, concurrency):
    engine = TargetEngine(target, n_slots=concurrency)
    proposer = load_proposer(drafter, target, n_slots=concurrency, max_context=engine.max_seq_len) if drafter else None
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), concurrency):
        outs += decode(engine, [GenerationRequest(p, max_new) for p in prompts[i:i + concurrency]], proposer)
    dt = time.perf_counter() - t0
    drafts = sum(o.stats.drafts for o in outs)
    gamma = 1 + sum(o.stats.accepted for o in outs) / drafts if drafts else 1.0
    return [o.token_ids for o in outs], sum(len(o.token_ids) for o in outs) / dt, gamma


def through_stack(cfg: StackConfig, prompts, max_new, concurrency):
    metrics_url = f"http://{cfg.host}:{cfg.metrics_port}/metrics"
    before = scrape_sums(metrics_url)

    def one(p):
        with Client(cfg.url) as c:
            return c.generate(prompt_ids=p, max_new_tokens=max_new, ignore_eos=True)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(one, prompts))
    dt = time.perf_counter() - t0
    after = scrape_sums(metrics_url)
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    rounds = max(d.get("flashmap_round_latency_seconds_count", 0.0), 1.0)
    split = {
        "draft_ms": 1e3 * d.get("flashmap_draft_latency_seconds_sum", 0.0) / rounds,
        "verify_ms": 1e3 * d.get("flashmap_verify_latency_seconds_sum", 0.0) / rounds,
        "round_ms": 1e3 * d.get("flashmap_round_latency_seconds_sum", 0.0) / rounds,
    }
    split["rest_ms"] = split["round_ms"] - split["draft_ms"] - split["verify_ms"]
    drafts = sum(o.stats.drafts for o in outs)
    gamma = 1 + sum(o.stats.accepted for o in outs) / drafts if drafts else 1.0
    fallback = sum(o.stats.fallback_rounds for o in outs)
    return [o.token_ids for o in outs], sum(len(o.token_ids) for o in outs) / dt, gamma, split, fallback


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--out", type=Path, default=OUT / "bench_stack.md")
    a = ap.parse_args(argv)
    target, drafter, notes = default_checkpoints(a.target, a.drafter)
    levels = [int(x) for x in a.concurrency.split(",")]
    rng = np.random.default_rng(0)
    engine = TargetEngine(target, n_slots=1)
    n_prompts = max(levels) * 2
    prompts = [rng.integers(0, engine.vocab_size, size=int(rng.integers(8, 32))).tolist() for _ in range(n_prompts)]
    kv_bytes = engine.kv_bytes_per_token
    del engine

    cfg = StackConfig.on_free_ports(target_dir=target, drafter=drafter, n_slots=max(levels), max_seq_len=512)
    rows = []
    with Stack(cfg) as stack:
        through_stack(cfg, prompts[:2], 8, 1)  # warm-up
        for c in levels:
            ar_ids, ar_tps, _ = inprocess(target, None, prompts, a.max_new_tokens, c)
            ip_ids, ip_tps, ip_gamma = inprocess(target, drafter, prompts, a.max_new_tokens, c)
            st_ids, st_tps, st_gamma, split, fallback = through_stack(cfg, prompts, a.max_new_tokens, c)
            assert ip_ids == ar_ids and st_ids == ar_ids, "speculative output differs from autoregressive"
            rows.append((c, ar_tps, ip_tps, ip_gamma, st_tps, st_gamma, split, fallback))
            print(f"concurrency {c}: target alone {ar_tps:.1f} tok/s, in-process {ip_tps:.1f}, stack {st_tps:.1f} "
                  f"(stack/in-process {st_tps / ip_tps:.2f}), gamma {st_gamma:.2f}, split {split}", flush=True)
        stats = DrafterAdmin(cfg.drafter_url, token=cfg.drafter_token).stats()
        mem = {
            "triton (server + Python stub)": peak_rss_mb(stack.triton.process.pid),
            "drafter": peak_rss_mb(stack.drafter_proc.pid),
            "orchestrator": peak_rss_mb(stack.orch_proc.pid),
        }

    proposer = load_proposer(drafter, target, n_slots=1, max_context=16)
    drafter_bytes = getattr(proposer, "bytes_per_context_token", 0)

    date = datetime.date.today().isoformat()
    lines = [
        "# Stack benchmark (CPU)", "",
        f"Date: {date}. Machine: {machine()}.",
        f"Command: `python -m bench.bench_stack --max-new-tokens {a.max_new_tokens} --concurrency {a.concurrency}`.",
        f"Target `{os.path.relpath(target)}`, drafter `{drafter}`; {n_prompts} prompts, greedy, {a.max_new_tokens} new tokens each.",
        *[f"Note: {n}" for n in notes], "",
        "All outputs (in-process speculative and stack) equal the target-alone output (checked by the script).", "",
        "| concurrency | target alone tok/s | in-process spec tok/s | stack tok/s | stack / in-process | mean acceptance length | draft ms/round | verify ms/round | orchestration + transport ms/round | fallback rounds |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c, ar, ip, ipg, st, stg, sp, fb in rows:
        lines.append(f"| {c} | {ar:.1f} | {ip:.1f} | {st:.1f} | {st / ip:.2f} | {stg:.2f} | {sp['draft_ms']:.2f} | "
                     f"{sp['verify_ms']:.2f} | {sp['rest_ms']:.2f} | {fb} |")
    lines += ["", "Peak resident memory (VmHWM, MB):", ""]
    lines += [f"- {k}: {v:.0f}" for k, v in mem.items()]
    lines += ["", "Per-sequence state, bytes per context token:", "",
              f"- target KV cache: {kv_bytes}", f"- drafter cross-attention K/V cache: {drafter_bytes}",
              f"- drafter stats after the run: {stats.active_sequences} active sequences, {stats.context_tokens} context tokens held"]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
