"""bench.gpu_e2e's report: each row's speedup over the target alone at its batch, the markdown
table of the rows, and what each column means (ABOUT).
"""

from __future__ import annotations

from bench.gpu_e2e_measure import COUNTED_ROUNDS
from bench.gpu_e2e_published import LABELS as PUBLISHED_LABELS

LABELS = {"target": "target alone", "oracle": "oracle (always right)", **PUBLISHED_LABELS}


def speedups(rows: list[dict]) -> None:
    """Each row's tokens/s over the target alone's at its batch (the same process)."""
    base = {r["batch"]: r.get("tokens_per_s") for r in rows if r["kind"] == "target"}
    for r in rows:
        if r.get("tokens_per_s") and base.get(r["batch"]):
            r["speedup"] = round(r["tokens_per_s"] / base[r["batch"]], 3)


def label(r: dict) -> str:
    if r["kind"] == "flashmap":
        return f"FlashMap {r['steps']} jump{'s' if r['steps'] > 1 else ''}"
    return LABELS[r["kind"]]


def table(rows: list[dict]) -> list[str]:
    """The markdown table of the rows."""
    f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = [
        "| row | batch | rounds | tokens | per round (ms) | kernels alone (ms) | ratio | host (ms) "
        "| verify / drafter / rest (ms) | tokens/s | speedup | acceptance | ops / round "
        "| H2D / D2H / scalar reads per round | output = target alone |",
        "|---|---:|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        g = r.get
        if "skipped" in r or "error" in r:
            lines.append(f"| {label(r)} | {r['batch']} | {g('skipped') or 'ERROR ' + r['error']} |")
            continue
        kern = " + ".join(f"{k} {v:.2f}" for k, v in g("kernels", {}).items())
        moved = " / ".join(
            f(g(f"{k}_per_round"), 1) for k in ("aten_h2d", "aten_d2h", "scalar_reads")
        )
        if "memcpy_h2d_per_round" in r:
            moved += (
                f" (memcpy {f(g('memcpy_h2d_per_round'), 1)} / {f(g('memcpy_d2h_per_round'), 1)})"
            )
        split = " / ".join(
            f(g(f"{k}_ms_per_round")) for k in ("verify_call", "draft_call", "other")
        )
        eq = g("outputs_equal_target")
        lines.append(
            f"| {label(r)} | {r['batch']} | {r['rounds']} | {r['tokens']} "
            f"| {f(g('wall_ms_per_round'))} | {f(g('kernels_ms_per_round'))} ({kern}) "
            f"| {f(g('ratio'))} | {f(g('host_ms_per_round'))} | {split} | {f(g('tokens_per_s'), 1)} "
            f"| {f(g('speedup'))} | {f(g('mean_acceptance_length'))} | {f(g('ops_per_round'), 0)} "
            f"| {moved} | {'-' if eq is None else f'{eq[0]}/{eq[1]}'} |"
        )
    return lines


ABOUT = (
    "Whole decode loops through `flashmap.inprocess.decode`, greedy, prompts of random ids. "
    "Per round: from the end of the prefill to the end of the last round, over the rounds "
    "(verify passes after the prefill). Kernels alone: the captured graphs replayed by "
    "themselves (CUDA events; on the CPU the static passes on the host clock): a decode step "
    "for the target alone, a verify of 17 for the oracle, a verify of 17 plus the drafter's "
    "flow for FlashMap. Host = per round - kernels alone. verify / drafter / rest: time in the "
    "verify calls, in the drafter calls, and the loop's own work. Acceptance: mean tokens "
    "committed per drafted round. Ops / round and copies: a TorchDispatchMode over "
    f"{COUNTED_ROUNDS} steady-state rounds of a second run (H2D / D2H: aten copies between "
    "host and device; memcpy: the CUDA profiler's). Speedup: tokens/s after the prefill over "
    "the target alone's at the same batch, same process. The oracle runs on the engine in "
    "batch-invariant mode (one graph of batch x 17), the other rows on its bucketed graphs."
)
