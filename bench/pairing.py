"""How far the VM lets bench_stack resolve a ratio: the same paths at one concurrency, paired in
different alternation designs, chunk by chunk.

bench_stack alternates five modes per chunk of prompts; a ratio of two of them should not
depend on which other modes run between. This script runs several designs on one stack
(for example in-process target and speculation off alone, in-process target and Triton alone
alone, and all five), each design `--passes` times, and reports every path's tokens/s against
the in-process target alone within each chunk: geometric mean over the chunks with a 95%
interval. Differences between designs for the same pair are the VM's, not the stack's.

Each finished design pass is saved beside the report (`--out` with .json); a stopped run
resumes at the next pass (`--fresh`: all again).

  python -m bench.pairing [--prompt-set "random ids"] [--designs ip,off/ip,tr/ip,tr,off,full,auto] \\
      [--passes 2] [--concurrency 1] [--prompts 64] [--chunks 16] [--max-new-tokens 48] [--fresh]

Paths: ip (target alone in process), ipk (fixed-K speculation in process), tr (target alone
through Triton), off, full, auto (the stack, as bench_stack runs them). Every path's outputs
are checked against ip's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

from bench.bench_stack import OUT, chunks_of, fmt_ci, prompt_sets, ratio_ci, run_mode, warm_up
from drafter_service.factory import load_proposer
from flashmap.measure import machine
from flashmap_cli.stack import Stack, StackConfig, default_checkpoints
from target_service.engine import TargetEngine

# The paths' short names and bench_stack's modes.
PATHS = {
    "ip": "target",
    "ipk": "spec",
    "tr": "triton",
    "off": "off",
    "full": "full",
    "auto": "auto",
}


def design_pass(
    paths: list[str],
    parts,
    max_new: int,
    c: int,
    engine,
    proposer,
    stack: Stack,
    auto: StackConfig,
    full: StackConfig,
) -> list[dict[str, float]]:
    """Every path on every chunk, the order reversed every chunk: seconds per path per chunk.
    Every path's outputs must equal the first's (ip, the target alone)."""
    rows = []
    for k, part in enumerate(parts):
        runs = {
            p: run_mode(
                PATHS[p],
                part,
                max_new,
                c,
                auto.decode_steps,
                engine,
                auto,
                full,
                stack.cpus,
                proposer,
            )
            for p in (paths if k % 2 == 0 else paths[::-1])
        }
        for p, r in runs.items():
            assert r["outputs"] == runs[paths[0]]["outputs"], (
                f"{p}: output differs from the target alone (chunk {k})"
            )
        rows.append({p: r["seconds"] for p, r in runs.items()})
    return rows


def against_ip(rows: list[dict[str, float]], path: str) -> str:
    """The path's tokens/s over the in-process target's, paired per chunk, with its interval."""
    return fmt_ci(ratio_ci([r["ip"] / r[path] for r in rows]))


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompt-set", default="random ids")
    ap.add_argument(
        "--designs",
        default="ip,off/ip,tr/ip,tr,off,full,auto",
        help="designs separated by '/', each a comma list of paths starting with ip",
    )
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument(
        "--slots",
        type=int,
        default=32,
        help="KV slots of both targets (bench_stack: its largest concurrency)",
    )
    ap.add_argument("--out", type=Path, default=OUT / "bench_pairing.md")
    ap.add_argument("--fresh", action="store_true")
    a = ap.parse_args(argv)
    designs = [d.split(",") for d in a.designs.split("/")]
    for d in designs:
        if d[0] != "ip" or not set(d) <= set(PATHS):
            ap.error(f"a design is a comma list of {', '.join(PATHS)} starting with ip: {d}")
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    target, drafter, _ = default_checkpoints(None, None)
    engine = TargetEngine(target, n_slots=a.slots, max_seq_len=512)
    prompts = prompt_sets(target, engine.vocab_size, a.prompts)[a.prompt_set]
    parts = chunks_of(prompts, a.concurrency, a.chunks)
    settings = {k: v for k, v in vars(a).items() if k not in ("out", "fresh")}
    saved_path = a.out.with_suffix(".json")
    saved = json.loads(saved_path.read_text()) if saved_path.exists() and not a.fresh else {}
    done: dict[str, list] = saved.get("passes", {}) if saved.get("settings") == settings else {}
    todo = [(p, d) for p in range(a.passes) for d in designs if len(done.get(",".join(d), [])) <= p]
    print(
        f"{a.passes * len(designs) - len(todo)} design passes saved, {len(todo)} to run", flush=True
    )
    if todo:
        cfg = StackConfig.on_free_ports(
            target_dir=target,
            drafter=drafter,
            n_slots=a.slots,
            max_seq_len=512,
            speculation="auto",
            pin_cpus=True,
        )
        proposer = load_proposer(drafter, target, n_slots=a.slots, max_context=engine.max_seq_len)
        with Stack(cfg) as stack:
            _, full = stack.extra_orchestrator("orchestrator-full", speculation="full")
            warm_up(cfg, full, engine, proposer, prompts)
            for p, d in todo:
                rows = design_pass(
                    d, parts, a.max_new_tokens, a.concurrency, engine, proposer, stack, cfg, full
                )
                done.setdefault(",".join(d), []).append(rows)
                saved_path.parent.mkdir(parents=True, exist_ok=True)
                saved_path.write_text(json.dumps({"settings": settings, "passes": done}, indent=1))
                print(
                    f"pass {p} {','.join(d)}: "
                    + ", ".join(f"{x} {against_ip(rows, x)}" for x in d[1:]),
                    flush=True,
                )

    lines = [
        f"# Pairing designs at concurrency {a.concurrency} (CPU)",
        "",
        "| design | path | pass | tokens/s / target alone in process [95% CI] | chunks |",
        "|---|---|---:|---:|---:|",
    ]
    for d in designs:
        key = ",".join(d)
        for x in d[1:]:
            for p, rows in enumerate(done[key]):
                lines.append(f"| {key} | {x} | {p} | {against_ip(rows, x)} | {len(rows)} |")
            every = [r for rows in done[key] for r in rows]
            lines.append(f"| {key} | {x} | all | {against_ip(every, x)} | {len(every)} |")
    lines += [
        "",
        f"Prompts: {a.prompt_set}, {a.prompts} in {len(parts)} chunks, {a.concurrency} at a time, {a.max_new_tokens} new tokens, greedy; "
        "within each chunk every path of the design runs once (order reversed every chunk); the ratio is the "
        "in-process target's seconds over the path's, geometric mean over chunks with Student's t on the logs. "
        "Paths: ip target alone in process, ipk fixed-K speculation in process, tr target alone through Triton, off / full / auto the stack "
        "(bench_stack's modes). Command: `python -m bench.pairing --prompt-set "
        f'"{a.prompt_set}" --designs {a.designs} --passes {a.passes} --prompts {a.prompts} --chunks {a.chunks} '
        f"--concurrency {a.concurrency} --max-new-tokens {a.max_new_tokens} --slots {a.slots}"
        f"{'' if a.out == OUT / 'bench_pairing.md' else f' --out {os.path.relpath(a.out)}'}`. Date: {datetime.date.today().isoformat()}. Machine: {machine()}.",
    ]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
