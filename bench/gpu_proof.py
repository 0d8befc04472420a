"""The GPU proof's report (scripts/gpu-proof.sh): one markdown file and its JSON, made from what
the sections wrote into the work directory, with every target set against its measured number.

    python -m bench.gpu_proof --work WORK --out OUT [--smoke] [--device NAME] [--commit SHA]

WORK holds sections.tsv (one line per section the script ran: name, exit status, seconds, time
cap, command), logs/NAME.log, and each section's output: a/gpu_check.json (bench.gpu),
b/gpu_e2e.json (bench.gpu_e2e), c/gpu_stack.json (bench.gpu_stack), d/settings.json with
d/flow/loss.csv and d/map/loss.csv (training.train_drafter). OUT gets gpu_proof.md and
gpu_proof.json (the sections' own JSON inside it). A smoke run's numbers check the tools on
tiny shapes on the CPU: its targets are not judged.

The targets (one H200, Qwen3-8B shape, bf16): a round at batch 1 costs <= 1.1 x its kernels
(<= 8.5 ms with the paper-size FlashMap drafter, <= 6.5 ms with the oracle); at batch 16 <= 1.3 x
(<= 20 ms); the stack at concurrency 1 >= 0.9 x the in-process loop with the same drafter and
acceptance; the target step <= 1.2 x its memory floor. Training is set against
docs/training.md's estimate.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import re
import sys
from pathlib import Path

SECTIONS = {
    "wheels": "wheels: what the machine lacks, from .whl/ (bench.gpu_proof_wheels)",
    "world": "world: random target and drafter checkpoints (bench.gpu_world)",
    "a": "a. kernels and exactness (bench.gpu)",
    "b": "b. whole decode loops in process (bench.gpu_e2e)",
    "c": "c. the served stack on the GPU (bench.gpu_stack)",
    "d-data": "d. training: token data (training.generate_data)",
    "d-flow": "d. training: flow stage (training.train_drafter, torchrun)",
    "d-distill": "d. training: distillation (training.train_drafter, torchrun)",
}
# docs/training.md, "Sizes": one H200, batch 256 (32 sequences of 2,048 tokens), arithmetic.
ESTIMATE = {"flow": dict(step_s=1.85, peak_gb=85.0), "distill": dict(step_s=2.0, peak_gb=95.0)}
TIMED_OUT = (124, 137)


def load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_sections(work: Path) -> list[dict]:
    out = []
    path = work / "sections.tsv"
    lines = path.read_text().splitlines() if path.is_file() else []
    for line in lines:
        name, rc, seconds, cap, command = line.split("\t", 4)
        rc = int(rc)
        status = "passed" if rc == 0 else "timed out" if rc in TIMED_OUT else f"failed ({rc})"
        if rc == 0 and name == "c" and "skipped" in (load(work / "c" / "gpu_stack.json") or {}):
            status = "skipped"
        out.append(
            dict(name=name, rc=rc, status=status, seconds=float(seconds), cap_s=int(cap))
            | dict(
                command=command.replace(str(work), "$WORK"),
                log_tail=_tail(work / "logs" / f"{name}.log", rc),
            )
        )
    return out


def _tail(log: Path, rc: int, n: int = 25) -> list[str]:
    """The last lines of a failed section's log."""
    if rc == 0 or not log.is_file():
        return []
    return log.read_text(errors="replace").splitlines()[-n:]


# ----------------------------------------------------------------------------- the numbers


def e2e_row(b: dict | None, kind: str, batch: int, steps: int = 0) -> dict | None:
    for r in (b or {}).get("rows", []):
        if (r["kind"], r["batch"], r["steps"]) == (kind, batch, steps) and "ratio" in r:
            return r
    return None


def target(text: str, section: str, value, limit: float, unit: str, at_most: bool = True):
    """One target: value against limit (None: not measured)."""
    met = None if value is None else (value <= limit if at_most else value >= limit)
    shown = "not measured" if value is None else f"{value:.3g}{unit}"
    return dict(target=text, section=section, value=value, limit=limit, measured=shown, met=met)


def targets(a: dict | None, b: dict | None, c: dict | None) -> list[dict]:
    out = []
    batches = ((b or {}).get("config") or {}).get("batches") or [1, 16]
    big = max(batches)
    at = f"batch {big}" + ("" if big == 16 else " (16 on a GPU)")
    for kind, steps, name in (
        ("flashmap", 1, "FlashMap 1 jump"),
        ("flashmap", 2, "FlashMap 2 jumps"),
        ("dflash", 0, "DFlash"),
        ("eagle3", 0, "EAGLE-3"),
        ("oracle", 0, "oracle"),
    ):
        r1, rb = e2e_row(b, kind, 1, steps), e2e_row(b, kind, big, steps)
        out.append(
            target(f"{name}: round / kernels at batch 1 <= 1.1", "b", r1 and r1["ratio"], 1.1, "x")
        )
        out.append(
            target(f"{name}: round / kernels at {at} <= 1.3", "b", rb and rb["ratio"], 1.3, "x")
        )
        if (kind, steps) == ("flashmap", 1):
            w1, wb = r1 and r1["wall_ms_per_round"], rb and rb["wall_ms_per_round"]
            out.append(target(f"{name}: round at batch 1 <= 8.5 ms", "b", w1, 8.5, " ms"))
            out.append(target(f"{name}: round at {at} <= 20 ms", "b", wb, 20.0, " ms"))
        if kind == "oracle":
            w1 = r1 and r1["wall_ms_per_round"]
            out.append(target("oracle: round at batch 1 <= 6.5 ms", "b", w1, 6.5, " ms"))
    cells = (c or {}).get("cells") or {}
    c1 = cells.get("1", {})
    for d in ("flashmap", "oracle"):
        v = c1.get(f"{d}-stack", {}).get("over_in_process")
        out.append(
            target(f"stack / in process, {d}, concurrency 1 >= 0.9", "c", v, 0.9, "x", False)
        )
    t = (a or {}).get("target") or {}
    step = ((t.get("graph") or {}).get("step b=1") or {}).get("ms")
    floor = t.get("floor_ms")
    ratio = step / floor if step and floor else None
    out.append(target("target step at batch 1 / memory floor <= 1.2", "a", ratio, 1.2, "x"))
    return out


def training_rows(work: Path) -> list[dict]:
    """Per stage: the steps' times from loss.csv (the first step, a warm-up, left out), tokens
    and blocks per second, the peak memory the trainer printed, and docs/training.md's estimate."""
    settings = load(work / "d" / "settings.json") or {}
    rows = []
    for stage, run, section in (("flow", "flow", "d-flow"), ("distill", "map", "d-distill")):
        row = dict(stage=stage, **settings)
        path = work / "d" / run / "loss.csv"
        if path.is_file():
            with open(path) as f:
                t = [float(r["elapsed_s"]) for r in csv.DictReader(f)]
            steps = [b - a for a, b in zip(t, t[1:])]
            if steps:
                s = sorted(steps)[len(steps) // 2]
                seqs = settings.get("batch_size", 0) / max(settings.get("anchors_per_seq", 1), 1)
                row |= dict(
                    steps_timed=len(steps),
                    step_s=round(s, 4),
                    tokens_per_s=round(seqs * settings.get("max_len", 0) / s, 1),
                    blocks_per_s=round(settings.get("batch_size", 0) / s, 1),
                )
        log = work / "logs" / f"{section}.log"
        text = log.read_text(errors="replace") if log.is_file() else ""
        m = re.search(r"\[train\] peak memory: ([\d.]+) GB (.*)", text)
        if m:
            row |= dict(peak_gb=float(m.group(1)), peak_what=m.group(2).strip())
        est = ESTIMATE[stage]
        row |= dict(estimate_step_s=est["step_s"], estimate_peak_gb=est["peak_gb"])
        if "step_s" in row:
            row["step_over_estimate"] = round(row["step_s"] / est["step_s"], 2)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- the report


def fmt(v, d: int = 2) -> str:
    if v is None:
        return "-"
    return f"{v:.{d}f}" if isinstance(v, float) else str(v)


def section_a(a: dict | None) -> list[str]:
    if not a:
        return ["No report (see the section's status above)."]
    env, t, d = a.get("env", {}), a.get("target", {}), a.get("drafter", {})
    floor, g = t.get("floor_ms"), t.get("graph") or {}
    lines = [
        f"Device {env.get('name', env.get('device'))}, torch {env.get('torch')}, "
        f"Triton {env.get('triton')}; copy {a.get('ceilings', {}).get('copy_GBps')} GB/s, bf16 "
        f"matmul {a.get('ceilings', {}).get('matmul_TFLOPs')} TFLOP/s.",
        "",
        f"Target ({t.get('dtype')}, context {t.get('context')}, memory floor {fmt(floor, 3)} ms), "
        "in CUDA graphs (ms, host clock):",
        "",
        "| batch | step | verify 17 | step / floor | verify / step |",
        "|---:|---:|---:|---:|---:|",
    ]
    for b in (1, 4, 16):
        st, vr = (g.get(f"{k} b={b}", {}).get("ms") for k in ("step", "verify17"))
        lines.append(
            f"| {b} | {fmt(st)} | {fmt(vr)} | {fmt(st / floor if st and floor else None)} "
            f"| {fmt(vr / st if st and vr else None)} |"
        )
    lat = d.get("latency") or {}
    lines += ["", "Drafter at the paper's size (ms per draft, host clock):", ""]
    lines += ["| batch | 1 jump | 2 jumps |", "|---:|---:|---:|"]
    for b in (1, 4, 16):
        ms = [
            (lat.get(f"graph steps={s} b={b}") or lat.get(f"eager steps={s} b={b}") or {}).get("ms")
            for s in (1, 2)
        ]
        lines.append(f"| {b} | {fmt(ms[0])} | {fmt(ms[1])} |")
    lines += ["", "Exactness (tiny random Qwen3):", ""]
    lines += [
        "| dtype | graph = eager (argmax) | speculative = autoregressive (1 / 2 jumps) "
        "| batch-invariant: verify = 17 steps, bitwise | batch-invariant: speculative = AR |",
        "|---|---|---|---|---|",
    ]
    for dt in ("fp32", "bf16"):
        e = a.get(f"exactness_{dt}") or {}
        if "error" in e:
            lines.append(f"| {dt} | ERROR {e['error'][:100]} | | | |")
            continue
        inv = e.get("invariant_verify17_vs_17_steps") or {}
        lines.append(
            f"| {dt} | {(e.get('graph_vs_eager') or {}).get('argmax_equal', '-')} "
            f"| {e.get('speculative_eq_autoregressive_steps1', '-')} / "
            f"{e.get('speculative_eq_autoregressive_steps2', '-')} "
            f"| {inv.get('features_bitwise_equal', '-')} "
            f"| {e.get('invariant_speculative_eq_autoregressive', '-')} |"
        )
    errs = [k for k, v in a.items() if isinstance(v, dict) and "error" in v]
    if errs:
        lines += ["", f"Parts with errors: {', '.join(errs)} (gpu_proof.json, key a)."]
    return lines


def section_b(b: dict | None) -> list[str]:
    if not b:
        return ["No report (see the section's status above)."]
    lines = list(b.get("table") or [])
    for name, e in (b.get("errors") or {}).items():
        lines += ["", f"Error in {name}: {e.get('error')}"]
    return lines


def section_c(c: dict | None) -> list[str]:
    if not c:
        return ["No report (see the section's status above)."]
    if "skipped" in c:
        return [f"Not measured: {c['skipped']}."]
    try:
        from bench.gpu_stack import tables
    except ImportError as e:  # what the stack imports is missing here: the JSON has the numbers
        return [f"The tables need bench.gpu_stack ({e}); the numbers are in gpu_proof.json, key c."]
    lines = [
        f"The stack and the in-process loop were ready {c.get('ready_s')} s after the start "
        f"(in process: {c.get('in_process')}).",
        "",
        *tables(c),
    ]
    if "error" in c:
        lines += ["", f"Error: {c['error']}"]
    return lines


def section_d(rows: list[dict]) -> list[str]:
    s = rows[0] if rows else {}
    lines = [
        f"Batch {s.get('batch_size')} blocks ({s.get('anchors_per_seq')} anchors per sequence), "
        f"sequences of up to {s.get('max_len')} tokens, {s.get('accum_steps', 1)} micro-batch(es) "
        "per step; the step time is the median over the steps after the first (loss.csv); "
        "tokens/s counts the target's feature pass (sequences x length per step).",
        "",
        "| stage | steps timed | step (s) | tokens/s | blocks/s | peak memory (GB) "
        "| estimate: step (s) / peak (GB) | step / estimate |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['stage']} | {fmt(r.get('steps_timed'))} | {fmt(r.get('step_s'), 3)} "
            f"| {fmt(r.get('tokens_per_s'), 0)} | {fmt(r.get('blocks_per_s'), 1)} "
            f"| {fmt(r.get('peak_gb'))} {r.get('peak_what', '')} "
            f"| {r['estimate_step_s']} / {r['estimate_peak_gb']:.0f} "
            f"| {fmt(r.get('step_over_estimate'))} |"
        )
    return lines


def markdown(report: dict) -> str:
    smoke = report["smoke"]
    mark = lambda m: "n/a (smoke)" if smoke else {True: "yes", False: "**no**", None: "-"}[m]  # noqa: E731
    lines = [
        "# GPU proof" + (": CPU smoke run (checks the tools; no speed claim)" if smoke else ""),
        "",
        f"Date {report['date']}. Device: {report['device']}. Commit: {report['commit']}. "
        f"Total {report['total_s']:.0f} s. Command: `{report['command']}` (work directory "
        f"WORK = {report['work']}).",
        "",
        "## Targets (one H200, Qwen3-8B shape, bf16)",
        "",
        "| target | measured | met | section |",
        "|---|---:|---|---|",
    ]
    for t in report["targets"]:
        lines.append(f"| {t['target']} | {t['measured']} | {mark(t['met'])} | {t['section']} |")
    lines += [
        "",
        "## Sections",
        "",
        "| section | status | seconds (cap) | command |",
        "|---|---|---:|---|",
    ]
    for s in report["sections"]:
        lines.append(
            f"| {SECTIONS.get(s['name'], s['name'])} | {s['status']} "
            f"| {s['seconds']:.0f} ({s['cap_s']}) | `{s['command']}` |"
        )
    for s in report["sections"]:
        if s["log_tail"]:
            lines += ["", f"Last lines of {s['name']}'s log:", "", "```", *s["log_tail"], "```"]
    parts = (
        ("a", section_a(report.get("a"))),
        ("b", section_b(report.get("b"))),
        ("c", section_c(report.get("c"))),
        ("d-flow", section_d(report.get("d") or [])),
    )
    for name, body in parts:
        lines += ["", f"## {SECTIONS[name].split(':')[0] if name == 'd-flow' else SECTIONS[name]}"]
        lines += ["", *body]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu_proof",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--device", default="unknown")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--command", default="bash scripts/gpu-proof.sh")
    ap.add_argument("--total-s", type=float, default=0.0)
    a = ap.parse_args(argv)
    w = a.work
    sections = read_sections(w)
    report = dict(
        date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        device=a.device,
        commit=a.commit,
        command=a.command,
        work=str(w),
        smoke=a.smoke,
        total_s=a.total_s,
        sections=sections,
        a=load(w / "a" / "gpu_check.json"),
        b=load(w / "b" / "gpu_e2e.json"),
        c=load(w / "c" / "gpu_stack.json"),
        d=training_rows(w),
        world=load(w / "world" / "world.json"),
    )
    report["targets"] = targets(report["a"], report["b"], report["c"])
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "gpu_proof.json").write_text(json.dumps(report, indent=1, default=str))
    text = markdown(report)
    (a.out / "gpu_proof.md").write_text(text)
    print(text, flush=True)
    failed = [s["name"] for s in sections if s["status"] not in ("passed", "skipped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
