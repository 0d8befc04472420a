"""The served stack on a GPU against the in-process loop with the same drafter and acceptance.

    python -m bench.gpu_stack --world DIR --out OUT            (a GPU: Qwen3-8B's shape, bf16)
    python -m bench.gpu_stack --world DIR --out OUT --smoke    (the tiny world, on the CPU)

DIR (bench.gpu_world) holds a target checkpoint and a FlashMap drafter checkpoint for it, both
with random weights. Two drafters, each decoded in process and served through the stack:

- flashmap: the world's drafter (the paper's size on the 8B shape; random, so about one token
  a round: the row measures what a round costs), the target applying its context projection;
- oracle: the target's own greedy continuation (drafter_service.oracle), in the stack behind
  bench.oracle_drafter: the whole block is accepted wherever the target agrees with it.

The stack is what `flashmap up --target T --drafter D --speculation full` starts
(flashmap_cli.stack.Stack: Triton serving the target, the drafter service, the orchestrator);
the oracle's drafter service and an orchestrator of its own run beside them over the same
Triton. In process: a TargetEngine over the same checkpoint (its CUDA graphs, the same context
projection) and the same drafters, through flashmap.inprocess.decode. Without a tritonserver on
the machine the tool says so in its report and measures nothing.

At each concurrency c, 2c prompts of random ids go c at a time through each path, greedy, the
whole block drafted every round; the paths alternate (`--repeats` times, in turn forwards and
backwards). Per path: tokens/s (all new tokens over the wall, prefill included), the mean
acceptance length, outputs equal to the target alone's; for the stack, tokens/s over the
in-process loop's with the same drafter, and per round the split read from the services'
metrics (bench.stack_paths.stack_summary): the orchestrator's draft and verify calls, the
drafter's forward, per batch of the target model its wait in Triton's queue and its run, the
whole round. OUT/gpu_stack.json has every number, OUT/gpu_stack.md the tables, OUT/logs the
services' logs.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.common import stamp, write_report
from bench.stack_paths import stack_summary, through_stack
from flashmap.cpus import on_cpus
from flashmap.grpc_serving import free_ports, wait_grpc_health
from flashmap.measure import machine
from flashmap_cli.stack import Stack, StackConfig

MODULE = "bench.gpu_stack"
SIZES = {
    "gpu": dict(concurrency="1,16", prompt_len=128, max_new_tokens=64, max_seq_len=512),
    "smoke": dict(concurrency="1,2", prompt_len=12, max_new_tokens=20, max_seq_len=128),
}
DRAFTERS = ("flashmap", "oracle")
PATHS = ("target", "flashmap", "flashmap-stack", "oracle", "oracle-stack")
LABELS = {
    "target": "target alone, in process",
    "flashmap": "FlashMap (random weights), in process",
    "flashmap-stack": "FlashMap (random weights), stack",
    "oracle": "oracle, in process",
    "oracle-stack": "oracle, stack",
}
SPLIT = (  # stack_summary's per-round keys, in the table's order
    ("draft call", "draft_ms"),
    ("drafter forward", "drafter_forward_ms"),
    ("verify call", "verify_ms"),
    ("Triton queue", "triton_queue_ms"),
    ("model run", "triton_compute_ms"),
    ("whole round", "round_ms"),
)


class ProofStack(Stack):
    """The stack `flashmap up` starts, plus a drafter service around the oracle and an
    orchestrator of its own over the same Triton (stopped with the stack). Each part runs in a
    session of its own: `record` writes their ids, so that whoever kills this process (a time
    cap) can end them too (scripts/gpu-proof.sh)."""

    def record(self, path: Path) -> None:
        procs = [self.triton and self.triton.process, self.drafter_proc, self.orch_proc]
        pids = [p.pid for p in [*procs, *self.extra_procs] if p is not None]
        path.write_text("".join(f"{pid}\n" for pid in pids))

    def start_oracle(self, refs: Path, vocab: int) -> StackConfig:
        port, metrics_port = free_ports(2)
        proc = self._spawn(
            "drafter-oracle",
            [
                "bench.oracle_drafter",
                *("--refs", str(refs), "--vocab", str(vocab)),
                *("--port", str(port), "--metrics-port", str(metrics_port)),
            ],
        )
        self.extra_procs.append(proc)
        wait_grpc_health(f"{self.cfg.host}:{port}", 120, proc, self._log("drafter-oracle"))
        _, cfg = self.extra_orchestrator(
            "orchestrator-oracle", drafter_port=port, drafter_metrics_port=metrics_port
        )
        return cfg


def in_process(engine, proposer, prompts, max_new: int, concurrency: int) -> dict:
    """The prompts `concurrency` at a time through flashmap.inprocess.decode."""
    from flashmap.inprocess import decode
    from flashmap.types import GenerationRequest

    outs, stats, t0 = [], [], time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        done = decode(
            engine, [GenerationRequest(p, max_new) for p in prompts[i : i + concurrency]], proposer
        )
        outs += [r.token_ids for r in done]
        stats += [r.stats for r in done]
    seconds = time.perf_counter() - t0
    drafts, accepted = sum(s.drafts for s in stats), sum(s.accepted for s in stats)
    return {
        "outputs": outs,
        "seconds": seconds,
        "tok_s": sum(len(o) for o in outs) / seconds,
        "gamma": 1 + accepted / drafts if drafts else 1.0,
    }


class Measure:
    """The in-process engine and drafters, the running stack, and the paths over them."""

    def __init__(self, a, world: Path, dev, log_dir: Path):
        self.a, self.dev = a, dev
        self.target, self.drafter = world / "target", world / "drafter"
        self.levels = [int(x) for x in a.concurrency.split(",")]
        self.cfg = StackConfig.on_free_ports(
            target_dir=str(self.target),
            drafter=str(self.drafter),
            n_slots=max(self.levels),
            max_seq_len=a.max_seq_len,
            speculation="full",
            log_dir=str(log_dir),
        )
        self.stack = ProofStack(self.cfg)
        self.oracle_cfg: StackConfig | None = None

    def build_in_process(self) -> dict:
        import torch

        from drafter_service.factory import load_proposer
        from flashmap.drafter_inputs import target_inputs
        from target_service.engine import TargetEngine

        t, cuda = time.perf_counter(), self.dev == "cuda"
        layers, proj = target_inputs(self.drafter, self.target)
        n, S = max(self.levels), self.a.max_seq_len
        self.engine = TargetEngine(
            self.target,
            n_slots=n,
            max_seq_len=S,
            device=self.dev,
            dtype=torch.bfloat16 if cuda else torch.float32,
            feature_layers=layers,
            context_projection=proj,
            cuda_graphs=cuda,
        )
        self.proposer = load_proposer(
            self.drafter, self.target, device=self.dev, n_slots=n, max_context=S
        )
        if cuda:  # as the drafter service does
            self.proposer.enable_graphs(steps=(1, 2))
        return {
            "build_s": round(time.perf_counter() - t, 1),
            "context_projection": proj is not None,
        }

    def run(self, path: str, prompts, c: int) -> dict:
        max_new = self.a.max_new_tokens
        if path.endswith("-stack"):
            cfg = self.oracle_cfg if path.startswith("oracle") else self.cfg
            with on_cpus(self.stack.cpus and self.stack.cpus[1]):
                return stack_summary([through_stack(cfg, prompts, max_new, c)])
        proposer = {"target": None, "flashmap": self.proposer, "oracle": self.oracle}[path]
        with on_cpus(self.stack.cpus and self.stack.cpus[0]):
            return in_process(self.engine, proposer, prompts, max_new, c)


def measure(a, world: Path, out: Path, report: dict, save) -> None:
    from drafter_service.oracle import OracleProposer

    dev = "cpu" if a.smoke else "cuda"
    m = Measure(a, world, dev, out / "logs")
    t = time.perf_counter()
    try:
        with ThreadPoolExecutor(1) as pool:  # the stack starts while this process loads its own
            started = pool.submit(m.stack.start)
            try:
                report["in_process"] = m.build_in_process()
            finally:
                started.result()
                m.stack.record(out / "pids")
        report["start_s"] = round(time.perf_counter() - t, 1)
        report["cpus"] = m.stack.cpus and [sorted(c) for c in m.stack.cpus]
        V = m.engine.vocab_size
        rng = np.random.default_rng(0)
        pool_n = 2 * max(m.levels)
        prompts = [rng.integers(3, V, a.prompt_len).tolist() for _ in range(pool_n)]
        alone = in_process(m.engine, None, prompts, a.max_new_tokens, max(m.levels))["outputs"]
        refs = [p + o for p, o in zip(prompts, alone)]
        (out / "refs.json").write_text(json.dumps(refs))
        m.oracle = OracleProposer(refs, vocab_size=V, feature_dim=m.engine.feature_dim)
        m.oracle_cfg = m.stack.start_oracle(out / "refs.json", V)
        m.stack.record(out / "pids")
        report["ready_s"] = round(time.perf_counter() - t, 1)
        say(f"stack and in-process loop ready after {report['ready_s']} s")
        for path in PATHS:  # warm-up: a short request through every path
            m.run(path, prompts[:1], 1)
        for c in m.levels:
            part = prompts[: 2 * c]
            runs: dict[str, list[dict]] = {p: [] for p in PATHS}
            for r in range(a.repeats):
                for path in PATHS if r % 2 == 0 else PATHS[::-1]:
                    runs[path].append(m.run(path, part, c))
            report["cells"][str(c)] = cell(runs, alone[: len(part)])
            say(
                f"c={c}: "
                + ", ".join(f"{p} {v['tok_s']:.1f}" for p, v in report["cells"][str(c)].items())
                + " tok/s"
            )
            save()
    finally:
        m.stack.stop()
        (out / "pids").unlink(missing_ok=True)


def cell(runs: dict[str, list[dict]], alone: list[list[int]]) -> dict:
    """Per path: mean tokens/s over the repeats, acceptance, outputs equal to the target alone's,
    the stack's ratio to the in-process loop with its drafter (within each repeat) and split."""
    out = {}
    for path, rs in runs.items():
        row = {
            "tok_s": float(np.mean([r["tok_s"] for r in rs])),
            "tok_s_per_repeat": [r["tok_s"] for r in rs],
            "acceptance": float(np.mean([r["gamma"] for r in rs])),
            "outputs_equal_target": [
                sum(x == y for x, y in zip(rs[-1]["outputs"], alone)),
                len(alone),
            ],
        }
        if path.endswith("-stack"):
            base = runs[path.removesuffix("-stack")]
            ratios = [s["tok_s"] / b["tok_s"] for s, b in zip(rs, base)]
            row["over_in_process"] = float(np.exp(np.mean(np.log(ratios))))
            row["split_ms"] = {key: float(np.mean([r[key] for r in rs])) for _, key in SPLIT}
            row["rounds"] = float(np.mean([r["rounds"] for r in rs]))
        out[path] = row
    return out


def tables(report: dict) -> list[str]:
    f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = [
        "| concurrency | path | tokens/s | acceptance | output = target alone | stack / in process |",
        "|---:|---|---:|---:|---|---:|",
    ]
    for c, paths in report["cells"].items():
        for p, r in paths.items():
            eq = r["outputs_equal_target"]
            lines.append(
                f"| {c} | {LABELS[p]} | {f(r['tok_s'], 1)} | {f(r['acceptance'])} "
                f"| {eq[0]}/{eq[1]} | {f(r.get('over_in_process'))} |"
            )
    lines += [
        "",
        "Per round of the stack (ms; draft and verify calls: the orchestrator's; Triton queue "
        "and model run: per batch of the target model):",
        "",
        "| concurrency | drafter | " + " | ".join(name for name, _ in SPLIT) + " |",
        "|---:|---|" + "---:|" * len(SPLIT),
    ]
    for c, paths in report["cells"].items():
        for d in DRAFTERS:
            s = paths.get(f"{d}-stack", {}).get("split_ms")
            if s:
                lines.append(f"| {c} | {d} | " + " | ".join(f(s[k]) for _, k in SPLIT) + " |")
    return lines


def say(msg: str) -> None:
    print(f"[gpu_stack] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog=f"python -m {MODULE}",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--world", type=Path, required=True, help="directory of bench.gpu_world")
    ap.add_argument("--out", type=Path, required=True, help="directory for the report")
    ap.add_argument("--smoke", action="store_true", help="the tiny world on the CPU")
    for name in ("concurrency", "prompt_len", "max_new_tokens", "max_seq_len"):
        ap.add_argument(f"--{name.replace('_', '-')}", default=None)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each path, alternated")
    a = ap.parse_args(argv)
    for k, v in SIZES["smoke" if a.smoke else "gpu"].items():
        setattr(a, k, v if getattr(a, k) is None else type(v)(getattr(a, k)))
    argv_list = sys.argv[1:] if argv is None else list(argv)
    report: dict = {"tool": MODULE, "argv": argv_list, "smoke": a.smoke, "cells": {}}
    report["config"] = {k: getattr(a, k) for k in (*SIZES["gpu"], "repeats")}
    a.out.mkdir(parents=True, exist_ok=True)

    def save():
        (a.out / "gpu_stack.json").write_text(json.dumps(report, indent=1, default=str))

    import torch

    from target_service.launcher import TritonStartError, find_tritonserver

    # A time cap's SIGTERM: leave through the finally blocks, which stop the stack.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report["machine"], rc = machine(), 0
    if not a.smoke and not torch.cuda.is_available():
        print(f"{MODULE}: no CUDA device here; --smoke runs it on the CPU", flush=True)
        return 2
    try:
        find_tritonserver()
    except TritonStartError as e:
        report["skipped"] = f"no tritonserver on this machine: {e}"
    if "skipped" not in report:
        try:
            measure(a, a.world, a.out, report, save)
        except Exception as e:  # noqa: BLE001 - write what there is
            report["error"] = f"{type(e).__name__}: {e}"
            report["traceback"] = traceback.format_exc()[-3000:]
            print(report["traceback"], flush=True)
            rc = 1
    save()
    if "skipped" in report:
        lines = [f"Not measured: {report['skipped']}."]
    else:
        lines = tables(report)
    title = "The served stack against the in-process loop" + (", CPU smoke run" if a.smoke else "")
    about = (
        f"{a.max_new_tokens} new tokens per request, prompts of {a.prompt_len} random ids, "
        f"2 x concurrency prompts per cell, greedy, the whole block drafted every round."
    )
    write_report(a.out / "gpu_stack.md", title, lines, about, MODULE, argv_list)
    print("\n".join(["", *lines, "", stamp(MODULE, argv_list)]), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
