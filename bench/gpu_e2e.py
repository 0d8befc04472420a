"""Whole decode loops on the GPU: what a speculative round costs against what its kernels cost.

  python -m bench.gpu_e2e --out DIR          (one GPU, e.g. an H200: about 3 minutes, guarded at --budget)
  python -m bench.gpu_e2e --smoke --out DIR  (tiny shapes on the CPU, fp32: the tool's own test)
  (also: python bench/gpu_e2e.py ...)

Every row decodes real requests to completion through the in-process runtime
(`flashmap.inprocess.decode`) over the target engine (`TargetEngine`, its CUDA graphs) at
batch 1, 4 and 16: 256-token prompts of random ids, 128 new tokens each, greedy. The target is
the Qwen3-8B shape with random bf16 weights built on the device (bench.gpu_target; nothing is
written to disk). In the order they run:

  target     the target alone: one token per request per round, against the replayed decode
             step (the captured graph of b rows x 1 token)
  flashmap   the FlashMap drafter at the paper's size (dim 2048, 6 blocks, 16 heads; random
             weights, so rarely right: the row measures what a round costs), 1 then 2 jumps,
             its CUDA graphs, against a verify of 17 plus the drafter's flow, each replayed
             alone (time is kept for the oracle)
  dflash     DFlash in its published layout at Qwen3-8B's size (5 layers at the target's width,
             a block of 16: 15 drafts; random weights), its graphs per (batch, context) bucket,
             against a verify of 17 plus its block pass (bench.gpu_e2e_published)
  oracle     a drafter that is always right (drafter_service.oracle over the target's own
             greedy output, decoded first) with the engine in batch-invariant mode (one graph
             of b x 17 for every pass, so the oracle is accepted in full): the loop's ceiling,
             against a verify of 17
  eagle3     EAGLE-3 in its published layout (one layer, a 32,000-token draft vocabulary, a tree
             of 16 drafts; random weights), its tree search in graphs, the trees verified row
             by row, against a verify of 17 plus its tree search; on an engine of its own (it
             reads 3 layers' features), so it runs last

Per row (ABOUT below says how each is measured): rounds, tokens, ms per round, kernels alone,
their ratio, host ms, the split between verify calls, drafter calls and the loop's own work,
tokens/s, speedup over the target alone, acceptance, whether the output equals the target
alone's, and the host's work per steady-state round (bench.gpu_timing.HostWork: torch ops
dispatched, copies between host and device, scalar reads; on CUDA the profiler's memcpy and
synchronize calls). On the CPU (--smoke) the graphs are static (the same padded passes, not
captured) and "kernels alone" is their host clock: the smoke run checks the tool, its numbers
are no speed claim.

A time guard (--budget) skips what would not fit and says so; a watchdog at budget + 45 s
writes what there is and exits. DIR gets gpu_e2e.json (every number), gpu_e2e.md (the table,
bench.gpu_e2e_report) and gpu_e2e.log. The current report is docs/results/gpu_h200.md ("Whole
decode loop"). How each number is taken: bench.gpu_e2e_measure.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # python bench/gpu_e2e.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench import gpu_timing  # noqa: E402
from bench.common import parser, stamp, write_report  # noqa: E402
from bench.gpu import env_section  # noqa: E402
from bench.gpu_drafter import build_drafter  # noqa: E402
from bench.gpu_e2e_measure import (  # noqa: E402
    COUNTED_ROUNDS,
    drafter_kernel_ms,
    host_work,
    requests_for,
    same,
    target_kernel_ms,
)
from bench.gpu_e2e_published import published_rows  # noqa: E402
from bench.gpu_e2e_report import ABOUT, speedups, table  # noqa: E402
from bench.gpu_target import QWEN3_8B, TINY_TARGET, random_qwen3  # noqa: E402
from bench.gpu_timing import (  # noqa: E402
    LOG,
    Guard,
    K,
    RoundClock,
    say,
    watchdog,
)
from flashmap.measure import machine  # noqa: E402

MODULE = "bench.gpu_e2e"
# The GPU run (Qwen3-8B's shape) and the CPU smoke run (tiny, seconds). need: seconds a row
# may take at batch b, (base, per row of the batch), and the drafter's build; the guard skips
# what would not fit in what is left.
SHAPES = {
    "gpu": dict(
        target=QWEN3_8B,
        init_std=0.02,
        batches=(1, 4, 16),
        prompt_len=256,
        max_new_tokens=128,
        dtype=torch.bfloat16,
        reps=20,
        need={
            "target": (8, 0.2),
            "oracle": (8, 0.3),
            "flashmap": (8, 1.2),
            "drafter": (40, 0),
            "dflash": (8, 1.0),
            "eagle3": (10, 1.5),  # its trees are verified row by row
        },
    ),
    "smoke": dict(
        target=TINY_TARGET,
        init_std=None,  # random_checkpoint's default: peaked logits, no near-ties in fp32
        batches=(1, 2),
        prompt_len=16,
        max_new_tokens=52,  # the oracle: 3 rounds of K + 1 after the prefill's token
        dtype=torch.float32,
        reps=2,
        need={k: (1, 0) for k in ("target", "oracle", "flashmap", "drafter", "dflash", "eagle3")},
    ),
}
KINDS_TO_SKIP = "target, oracle, flashmap, flashmap1, flashmap2, dflash, eagle3"


class Run:
    """The rows of one call, over one target engine (its graphs switched between rows)."""

    def __init__(self, a, dev, guard: Guard, report: dict, save):
        from target_service.engine import TargetEngine
        from target_service.random_checkpoint import default_init_std

        self.shape = shape = SHAPES["smoke" if a.smoke else "gpu"]
        self.a, self.dev, self.guard, self.report, self.save = a, dev, guard, report, save
        self.batches = tuple(a.batches or shape["batches"])
        self.plen = a.prompt_len or shape["prompt_len"]
        self.max_new = a.max_new_tokens or shape["max_new_tokens"]
        self.jumps = tuple(int(s) for s in a.steps.split(",") if s)
        self.skip = set(filter(None, a.skip.split(",")))
        self.mode = "cuda" if dev.type == "cuda" else "static"
        self.at = self.plen + self.max_new // 2  # a mid-run context: where kernels are timed
        self.dtype, self.reps = shape["dtype"], shape["reps"]
        report["config"] = dict(
            batches=list(self.batches),
            prompt_len=self.plen,
            max_new_tokens=self.max_new,
            jumps=list(self.jumps),
            dtype=str(self.dtype),
            graphs=self.mode,
            kernels_at_context=self.at,
            target=shape["target"],
        )
        t = time.perf_counter()
        std = shape["init_std"] or default_init_std(shape["target"]["hidden_size"])
        self.model = random_qwen3(shape["target"], dev, self.dtype, std)
        self.engine = TargetEngine.from_model(
            self.model,
            n_slots=max(self.batches),
            max_seq_len=self.plen + self.max_new + K + 1,
            eos_token_ids=[],  # every request decodes max_new tokens
        )
        report["target"] = dict(
            params=sum(p.numel() for p in self.model.parameters()),
            ops=self.model.ops.describe(),
            kernel_check=self.engine.kernel_check,
            feature_layers=self.engine.feature_layers,
            build_s=round(time.perf_counter() - t, 2),
        )
        say(f"target: {report['target']}")
        V = self.engine.vocab_size
        self.prompts = np.random.default_rng(0).integers(0, V, (max(self.batches), self.plen))
        self.alone: dict[int, list[list[int]]] = {}  # batch -> the target alone's tokens

    # ------------------------------------------------------------------ one row
    def need(self, kind: str, b: int) -> float:
        """Seconds a row may take (the drafter's build: kind "drafter"), for the tokens asked."""
        base, per_row = self.shape["need"][kind]
        scale = 1.0 if kind == "drafter" else self.max_new / self.shape["max_new_tokens"]
        return (base + per_row * b) * scale

    def row(self, kind: str, b: int, steps: int, fn, reserve: float = 0.0) -> None:
        """fn() -> the row, unless skipped (--skip, the time guard) or failed: then the row
        says so. The report is saved after each row."""
        name = f"{kind}{steps or ''} b={b}"
        if kind in self.skip or f"{kind}{steps}" in self.skip:
            return
        r = {"kind": kind, "batch": b, "steps": steps}
        if not self.guard.fits(self.need(kind, b) + reserve):
            r["skipped"] = f"time guard: {self.guard.left():.0f} s left"
            say(f"{name}: skipped ({r['skipped']})")
        else:
            say(f"{name} ...")
            try:
                r = fn()
                say(f"{name}: {json.dumps({k: v for k, v in r.items() if 'top_ops' not in k})}")
            except Exception as e:  # noqa: BLE001 - keep the other rows
                r["error"] = self.failed(name, e)
        self.report["rows"].append(r)
        self.save()

    def failed(self, name: str, e: Exception) -> str:
        err = f"{type(e).__name__}: {e}"
        self.report["errors"][name] = {"error": err, "traceback": traceback.format_exc()[-3000:]}
        say(f"{name} FAILED: {err}")
        print(self.report["errors"][name]["traceback"], flush=True)
        return err

    def measure(self, kind: str, b: int, proposer=None, steps=None, kernels=None):
        """One row: the host-work run (also the warm-up), the timed run, then the kernels
        alone (kernels() -> {part: ms}). Returns the row and each request's tokens."""
        from flashmap.inprocess import decode

        eng, dev = self.engine, self.dev
        per_round = K + 1 if kind == "oracle" else 1  # the random drafter is rarely right
        tail = 1 if kind in ("target", "oracle") else K + 1  # a drafter drafts K with K tokens left
        counted = min(self.max_new, 1 + per_round * (1 + COUNTED_ROUNDS) + tail)
        r = {"kind": kind, "batch": b, "steps": steps or 0}
        r.update(host_work(eng, requests_for(self.prompts, b, counted), proposer, steps, dev))
        gpu_timing.sync(dev)
        with RoundClock(eng) as clock:
            results = decode(eng, requests_for(self.prompts, b, self.max_new), proposer, steps)
        gpu_timing.sync(dev)
        r.update(clock.summary())
        n, tokens = r["rounds"], [x.token_ids for x in results]
        r["tokens"] = sum(len(t) for t in tokens)
        r["decode_s"] = round(results[0].wall_s, 3)
        if n:
            r["tokens_per_s"] = round((r["tokens"] - b) / r["steady_s"], 2)  # after the prefill
        st = [x.stats for x in results]
        drafts, accepted = sum(s.drafts for s in st), sum(s.accepted for s in st)
        if drafts:
            r.update(drafts=drafts, accepted=accepted, draft_tokens=sum(s.draft_tokens for s in st))
            r["mean_acceptance_length"] = round(1 + accepted / drafts, 3)
            r["accepted_in_full"] = accepted == r["draft_tokens"]
            r["draft_call_ms_per_round"] = round(1e3 * max(s.draft_s for s in st) / max(n, 1), 4)
        if n:
            busy = r["verify_call_ms_per_round"] + r.get("draft_call_ms_per_round", 0.0)
            r["other_ms_per_round"] = round(r["wall_ms_per_round"] - busy, 4)
        try:
            parts = kernels()
            r["kernels"] = {k: round(v, 4) for k, v in parts.items()}
            r["kernels_ms_per_round"] = kern = round(sum(parts.values()), 4)
            if n:
                r["ratio"] = round(r["wall_ms_per_round"] / kern, 3)
                r["host_ms_per_round"] = round(r["wall_ms_per_round"] - kern, 4)
        except Exception as e:  # noqa: BLE001 - the loop's numbers stand without the kernels'
            r["kernels_error"] = f"{type(e).__name__}: {e}"
        return r, tokens

    def verify_kernel_ms(self, eng, b: int) -> float:
        """A verify of K + 1 tokens for b rows on `eng`, its captured pass alone."""
        return target_kernel_ms(eng, b, K + 1, self.at, self.dev, self.reps)

    # ------------------------------------------------------------------ the rows
    def target_rows(self) -> None:
        """The target alone over the default buckets (what cuda_graphs=True captures)."""
        eng, at, reps = self.engine, self.at, self.reps
        self.report["capture"] = {"target": eng.enable_graphs(mode=self.mode)}
        say(f"target graphs: {self.report['capture']['target']}")
        for b in self.batches:

            def fn(b=b):
                step = lambda: {"step": target_kernel_ms(eng, b, 1, at, self.dev, reps)}  # noqa: E731
                r, self.alone[b] = self.measure("target", b, kernels=step)
                return r

            self.row("target", b, 0, fn)

    def flashmap_rows(self) -> None:
        """The FlashMap drafter (paper size; tiny with --smoke), 1 and 2 jumps, its graphs, over
        the same engine. The oracle's rows are kept time for."""
        from drafter_service.flashmap_proposer import FlashMapProposer

        if "flashmap" in self.skip or not self.jumps:
            return
        reserve = sum(self.need("oracle", b) for b in self.batches)
        if not self.guard.fits(self.need("drafter", 0) + reserve):
            return say(f"flashmap rows: skipped (time guard, {self.guard.left():.0f} s left)")
        eng, dev, t = self.engine, self.dev, time.perf_counter()
        try:
            drafter = build_drafter(
                dev,
                self.dtype,
                self.a.smoke,
                embed=self.model.model.embed_tokens.weight.detach(),
                lm_head=self.model.lm_head.weight.detach(),
                feature_layers=eng.feature_layers,
                target_num_layers=eng.num_layers,
            )
            prop = FlashMapProposer(
                drafter, n_slots=max(self.batches), max_context=eng.max_seq_len, device=str(dev)
            )
            self.report["drafter"] = dict(
                params=sum(p.numel() for p in drafter.parameters()),
                arch={k: getattr(drafter.cfg, k) for k in ("dim", "n_blocks", "n_heads")},
                build_s=round(time.perf_counter() - t, 2),
            )
            self.report["capture"]["drafter"] = prop.enable_graphs(steps=self.jumps, mode=self.mode)
        except Exception as e:  # noqa: BLE001
            self.failed("drafter", e)
            return
        say(f"drafter: {self.report['drafter']} graphs {self.report['capture']['drafter']}")
        for steps in self.jumps:
            for b in self.batches:

                def fn(b=b, steps=steps):
                    kernels = lambda: {  # noqa: E731
                        "verify17": target_kernel_ms(eng, b, K + 1, self.at, dev, self.reps),
                        "drafter": drafter_kernel_ms(prop, b, steps, self.at, dev, self.reps),
                    }
                    r, toks = self.measure("flashmap", b, prop, steps, kernels)
                    r["outputs_equal_target"] = same(toks, self.alone.get(b))
                    return r

                self.row("flashmap", b, steps, fn, reserve)
        prop = drafter = None  # freed before the oracle rows
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    def oracle_rows(self) -> None:
        """The always-right oracle over the target's own greedy output, decoded first on the
        engine in batch-invariant mode (one graph of b x 17: every pass the same shape)."""
        from drafter_service.oracle import OracleProposer
        from flashmap.inprocess import decode

        eng = self.engine
        for b in self.batches:

            def fn(b=b):
                self.report["capture"][f"invariant b={b}"] = eng.enable_graphs(
                    batch_buckets=(b,), query_buckets=(K + 1,), mode=self.mode, batch_invariant=True
                )
                refs = decode(eng, requests_for(self.prompts, b, self.max_new))
                oracle = OracleProposer(
                    [p.tolist() + x.token_ids for p, x in zip(self.prompts, refs)],
                    vocab_size=eng.vocab_size,
                    feature_dim=eng.feature_dim,
                )
                verify = lambda: {  # noqa: E731
                    "verify17": target_kernel_ms(eng, b, K + 1, self.at, self.dev, self.reps)
                }
                r, toks = self.measure("oracle", b, oracle, None, verify)
                r["outputs_equal_reference"] = same(toks, [x.token_ids for x in refs])
                r["outputs_equal_target"] = same(toks, self.alone.get(b))
                return r

            self.row("oracle", b, 0, fn)
        eng.disable_graphs()


def main(argv=None) -> int:
    ap = parser(MODULE, __doc__, max_new_tokens=None)
    gpu_timing.add_options(ap, "gpu_e2e.json, .md and .log", 175.0, KINDS_TO_SKIP)
    ap.add_argument(
        "--batches",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="batch sizes (default 1,4,16; smoke 1,2)",
    )
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 256)")
    ap.add_argument("--steps", default="1,2", help="drafter jumps, comma-separated")
    a = ap.parse_args(argv)
    dev = gpu_timing.device_for(a, MODULE)
    if dev is None:
        return 2
    argv_list = sys.argv[1:] if argv is None else list(argv)
    report: dict = dict(
        tool=MODULE,
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        argv=argv_list,
        smoke=a.smoke,
        budget_s=a.budget,
        rows=[],
        errors={},
    )

    def save(final: bool = False):
        report["elapsed_s"] = round(time.perf_counter() - gpu_timing.T0, 1)
        speedups(report["rows"])
        if final:
            report["table"] = table(report["rows"])
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "gpu_e2e.json").write_text(json.dumps(report, indent=1, default=str))
            (a.out / "gpu_e2e.log").write_text("\n".join(LOG) + "\n")
            if final:
                title = "Whole decode loop (bench.gpu_e2e)" + (", CPU smoke run" if a.smoke else "")
                write_report(a.out / "gpu_e2e.md", title, report["table"], ABOUT, MODULE, argv_list)

    def finish():
        save(final=True)
        print("\n".join(["", *report["table"], "", stamp(MODULE, argv_list)]), flush=True)

    def on_watchdog():
        report["errors"]["watchdog"] = {"error": "a row was still running at the watchdog"}
        finish()

    timer = watchdog(a.budget + 45, on_watchdog)
    try:
        report["env"], report["machine"] = env_section(dev), machine()
        run = Run(a, dev, Guard(a.budget), report, save)
        run.target_rows()
        run.flashmap_rows()
        published_rows(run, "dflash")
        run.oracle_rows()
        published_rows(run, "eagle3")  # last: its engine replaces the first one's caches
    except Exception as e:  # noqa: BLE001 - write what there is
        report["errors"]["run"] = {
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()[-3000:],
        }
        say(f"FAILED: {report['errors']['run']['error']}")
        print(report["errors"]["run"]["traceback"], flush=True)
    timer.cancel()
    finish()
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
