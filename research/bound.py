"""What a one-jump sampling drafter can reach on this target: the bound, measured before training.

At held-out anchors (training.heldout; the anchors and seeds of training.flow_diagnostics and
research.mode_probe) every drafter row drafts a block and the target verifies it (one verify
pass per block): at T = 0 alpha_k = [d_k = target argmax], at T > 0 alpha_k = min(1, p_k(d_k) /
q_k(d_k)) with q the drafter's own law; gamma = 1 + sum_k prod_{j<=k} alpha_j. A row may draft
by sampling (`sample`: T = 1, from the top `top` tokens, default the whole vocabulary) while the
target verifies at T = 0: the EAGLE-style chain sampling at T = 1 drafts a coherent sample of
its joint, which is what a perfect flow map of that joint would draft from its noise; its gamma
at T = 0 is the bound of any drafter that samples that joint. `draws=N` averages N independent
draws per anchor (the interval is still over sequences).

Beside the draws, sampling rows of the chain and of the DFlash-style drafter get the exact
expectation along the reference: with the target's own T = 0 answers as held-out data the
block is accepted up to the first slot that leaves the reference, so E[gamma] = 1 + sum_k
prod_{j<=k} q_j(y_j | y_<j) (the chain teacher-forced along the reference y; per-slot
marginals for DFlash). The draws must agree with it: that is the check that the sampling,
the verify and the anchors fit together.

    python -m research.bound --target checkpoints/demo-target --data runs/test-greedy \\
        --row dflash=checkpoints/demo-dflash-eq --row chain=checkpoints/demo-eagle \\
        --row chain-sampled=checkpoints/demo-eagle:1,sample,draws=8 \\
        --pair chain-sampled:dflash --temperature 0 --max-anchors 12 --threads 1 --out runs/bound/t0.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from flashmap.types import BLOCK_SIZE
from training.heldout import anchor_rounds, heldout_sequences, spread_anchors
from training.shuffle_test import acceptance, paired_bootstrap, proposal_prob


@dataclass
class RowSpec:
    """One drafter row: NAME=DIR[:STEPS][,sample][,top=M][,draws=N][,scale=S][,estimate=argmax][,q1]
    (DIR "target": the target itself sampling at T = 1, exact, verified at T = 0)."""

    name: str
    path: str
    steps: int = 1
    sample: bool = False  # draft at T = 1 (else greedy: the drafter's T = 0 proposal)
    top: int = 0  # sampling support: the top M tokens (0: the whole vocabulary)
    draws: int = 1  # independent draws per anchor, averaged
    # FlashMapProposer greedy_noise_scale (0: drafting from a zero state, a departure; None: the
    # paper's 1)
    scale: float | None = None
    estimate: str | None = None  # FlashMapProposer greedy_estimate (None: the paper's soft)
    # T > 0: verify a sampled block as a deterministic proposal (q = 1), as a flow map that
    # drafts that block from its noise with a one-hot readout is verified given its noise
    q1: bool = False

    def label(self) -> str:
        bits = [f"{self.steps} step{'s' * (self.steps > 1)}"]
        if self.sample:
            bits.append(f"sampled T = 1, top {self.top or 'V'}")
        if self.scale is not None:
            bits.append(f"noise x{self.scale:g}")
        if self.estimate is not None:
            bits.append(f"{self.estimate} estimate")
        if self.q1:
            bits.append("verified with q = 1")
        if self.draws > 1:
            bits.append(f"{self.draws} draws")
        return ", ".join(bits)


def parse_row(text: str) -> RowSpec:
    name, _, rest = text.partition("=")
    parts = rest.split(",")
    path, _, steps = parts[0].partition(":")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR[:STEPS][,OPTION...], got {text!r}")
    r = RowSpec(name, path, int(steps) if steps else 1)
    for p in parts[1:]:
        k, _, v = p.partition("=")
        if k == "sample":
            r.sample = True
        elif k == "q1":
            r.q1 = True
        elif k in ("top", "draws"):
            setattr(r, k, int(v))
        elif k == "scale":
            r.scale = float(v)
        elif k == "estimate":
            r.estimate = v
        else:
            raise argparse.ArgumentTypeError(f"unknown row option {p!r}")
    return r


@dataclass
class Measured:
    """Per anchor: its sequence and domain, gamma averaged over the draws, and (sampling rows
    of the chain and of DFlash-style drafters, T = 0) the exact expectation along the reference."""

    seq: list = field(default_factory=list)
    domain: list = field(default_factory=list)
    gamma: list = field(default_factory=list)
    exact: list = field(default_factory=list)
    # T = 0: anchors where the target's argmax left the held-out reference inside the accepted
    # prefix (near-ties between a verify pass and the decode that made the data)
    off_reference: int = 0


@torch.inference_mode()
def chain_reference_probs(
    proposer, requests, ref: np.ndarray, temperature: float = 1.0, top: int = 0
) -> np.ndarray:
    """[B, K] q_k(ref_k | ref_<k): the EAGLE-style chain (an EagleProposer, contexts cached)
    teacher-forced along ref [B, K], its law softmax(logits / T) over the top `top` tokens
    (0: all). EagleProposer.propose's drafting loop with the sampled token replaced by ref_k."""
    B, K, dev = len(requests), proposer.block_size, proposer.device
    rows = [proposer.slots.lookup(r.seq_id) for r in requests]
    L = np.array([length for _, length in rows], np.int64)
    p0 = np.maximum(L - 1, 0)
    T = int(p0.max()) + K
    slot_t = torch.tensor([max(s, 0) for s, _ in rows], device=dev)
    keep = int(p0.max())
    c = proposer.cfg
    kbuf, vbuf = [], []
    for i in range(c.n_layers):
        kb = proposer.k_cache.new_zeros(B, c.n_heads, T, c.head_dim)
        vb = torch.zeros_like(kb)
        if keep:
            kb[:, :, :keep] = proposer.k_cache[i, :, :, :keep].index_select(0, slot_t)
            vb[:, :, :keep] = proposer.v_cache[i, :, :, :keep].index_select(0, slot_t)
        kbuf.append(kb)
        vbuf.append(vb)
    p0_t = torch.from_numpy(p0).to(dev)
    g = proposer.g_cache[slot_t, p0_t]
    g = torch.where(torch.from_numpy(L > 0).to(dev)[:, None], g, torch.zeros_like(g))
    tok = torch.tensor([int(r.anchor) for r in requests], device=dev)
    ref_t = torch.from_numpy(np.asarray(ref, np.int64)).to(dev)
    rows_t, key_idx = torch.arange(B, device=dev), torch.arange(T, device=dev)
    out = np.zeros((B, K))
    for k in range(K):
        h, logits = proposer._step(g, tok, p0_t + k, kbuf, vbuf, rows_t, key_idx)
        lg = logits.double() / temperature
        if top and top < lg.shape[-1]:
            cut = lg.topk(top, dim=-1).values[:, -1:]
            lg = lg.masked_fill(lg < cut, float("-inf"))
        out[:, k] = lg.softmax(-1).gather(1, ref_t[:, k : k + 1])[:, 0].cpu().numpy()
        tok = ref_t[:, k]
        g = proposer.model.hidden_in(h)
    return out


def _alpha(res, draft, temperature: float, q1: bool = False) -> np.ndarray:
    if temperature == 0:
        return (draft.tokens == res.argmax[: len(draft.tokens)]).astype(np.float64)
    p = res.support_probs[:, 0].astype(np.float64)  # support = the drafted tokens
    return np.minimum(1.0, p / (1.0 if q1 else np.maximum(proposal_prob(draft), 1e-12)))


def _draw_seed(seed: int, j: int) -> int:
    return seed if j == 0 else int(np.random.SeedSequence([seed, j]).generate_state(1)[0])


@torch.no_grad()
def measure(
    engine,
    proposer,
    seqs,
    spec: RowSpec,
    temperature: float,
    max_anchors: int | None = 12,
    seed: int = 0,
) -> Measured:
    """Draft with `proposer` at every held-out anchor as `spec` says and verify at
    `temperature` (see the module docstring)."""
    from flashmap.types import SamplingParams, VerifyRow

    K, V = proposer.block_size, proposer.vocab_size
    kind = getattr(proposer.model.cfg, "kind", "")
    draft_T = 1.0 if spec.sample else 0.0
    top = spec.top or V
    params = SamplingParams(temperature=float(temperature))
    exact = spec.sample and temperature == 0 and kind in ("eagle", "dflash")
    out = Measured()
    n_par = min(engine.n_slots, proposer.n_slots)
    for g0 in range(0, len(seqs), n_par):
        group = seqs[g0 : g0 + n_par]
        anchors = [spread_anchors(s, K, max_anchors) for s in group]
        slots = [engine.allocate() for _ in group]
        ref_kv = [0] * len(group)
        try:
            for r, live, reqs in anchor_rounds(proposer, group, anchors, draft_T, top, seed):
                if kind in ("flashmap", "dflash"):  # FlashMapProposer: N noise draws at once
                    per_req = proposer.propose_blocks(reqs, spec.steps, n_blocks=spec.draws)
                    draws = [[b[j] for b in per_req] for j in range(spec.draws)]
                else:  # the chain: one call per draw, seeds derived from the request's
                    draws = [
                        proposer.propose(
                            [replace(q, seed=_draw_seed(q.seed, j)) for q in reqs], spec.steps
                        )
                        for j in range(spec.draws)
                    ]
                refs = np.stack(
                    [group[i].tokens[anchors[i][r] + 1 : anchors[i][r] + 1 + K] for i in live]
                )
                gam = np.zeros((spec.draws, len(live)))
                for j, ds in enumerate(draws):
                    rows = []
                    for i, d in zip(live, ds):
                        s, a = group[i], anchors[i][r]
                        start = min(a, ref_kv[i])  # past ref_kv: drafts of an earlier anchor
                        rows.append(
                            VerifyRow(
                                slots[i],
                                start,
                                np.concatenate([s.tokens[start : a + 1], d.tokens]),
                                params,
                                support_ids=d.tokens[:, None],
                                features=False,
                            )
                        )
                    for n, (d, res) in enumerate(zip(ds, engine.verify(rows))):
                        al = _alpha(res, d, temperature, spec.q1)
                        gam[j, n] = acceptance(al)
                        if temperature == 0:
                            m = int(np.cumprod(al).sum())  # accepted prefix
                            out.off_reference += int(
                                (res.argmax[:m] != refs[n][:m]).any()
                                or (m < K and res.argmax[m] != refs[n][m])
                            )
                if exact:
                    if kind == "eagle":
                        q = chain_reference_probs(proposer, reqs, refs, 1.0, spec.top)
                    else:  # per-slot marginals: the sampled blocks' full support
                        q = np.stack(
                            [
                                np.where(d.support_ids == y[:, None], d.support_probs, 0.0).sum(-1)
                                for d, y in zip(draws[0], refs)
                            ]
                        )
                    out.exact += [1.0 + np.cumprod(qq).sum() for qq in q]
                for i in live:
                    ref_kv[i] = anchors[i][r] + 1
                out.seq += [group[i].index for i in live]
                out.domain += [group[i].domain for i in live]
                out.gamma += gam.mean(0).tolist()
        finally:
            for sl in slots:
                engine.release(sl)
    return out


@torch.no_grad()
def target_sampled(engine, seqs, block_size: int, max_anchors: int | None = 12) -> Measured:
    """The target itself as a drafter sampling at T = 1, verified at T = 0 (exact): E[gamma] =
    1 + sum_k prod_{j<=k} p_T=1(y_j | y_<j) along the held-out T = 0 answer y. The bound of a
    drafter that samples the target's own T = 1 law (one trained on T = 1 samples, perfectly)."""
    from flashmap.types import SamplingParams, VerifyRow

    K, out = block_size, Measured()
    params = SamplingParams(temperature=1.0)
    for g0 in range(0, len(seqs), engine.n_slots):
        group = seqs[g0 : g0 + engine.n_slots]
        anchors = [spread_anchors(s, K, max_anchors) for s in group]
        slots = [engine.allocate() for _ in group]
        try:
            for r in range(max(len(a) for a in anchors)):
                live = [i for i, a in enumerate(anchors) if r < len(a)]
                rows = []
                for i in live:
                    s, a = group[i], anchors[i][r]
                    ref = s.tokens[a + 1 : a + 1 + K]
                    rows.append(
                        VerifyRow(
                            slots[i],
                            0,
                            s.tokens[: a + 1 + K],
                            params,
                            support_ids=ref[:, None],
                            features=False,
                        )
                    )
                for i, res in zip(live, engine.verify(rows)):
                    e = 1.0 + float(np.cumprod(res.support_probs[:, 0].astype(np.float64)).sum())
                    out.seq.append(group[i].index)
                    out.domain.append(group[i].domain)
                    out.gamma.append(e)
                    out.exact.append(e)
        finally:
            for sl in slots:
                engine.release(sl)
    return out


def summarize(m: Measured, base: Measured | None = None, seed: int = 0) -> dict:
    """gamma per domain and all, with bootstrap intervals over sequences; paired against base."""
    seq, dom, g = np.array(m.seq), np.array(m.domain), np.array(m.gamma)
    row: dict = dict(anchors=len(g), sequences=len(set(m.seq)), off_reference=m.off_reference)
    for d in sorted(set(m.domain)) + ["all"]:
        sel = np.ones(len(g), bool) if d == "all" else dom == d
        row[f"gamma_{d}"] = paired_bootstrap(g[sel], clusters=seq[sel], seed=seed)
        if m.exact:
            ex = np.array(m.exact)
            row[f"exact_{d}"] = paired_bootstrap(ex[sel], clusters=seq[sel], seed=seed)
            row[f"draws_minus_exact_{d}"] = paired_bootstrap(g[sel], ex[sel], seq[sel], seed=seed)
        if base is not None:
            row[f"vs_base_{d}"] = paired_bootstrap(
                g[sel], np.array(base.gamma)[sel], seq[sel], seed=seed
            )
    return row


def _ci(d: dict, fmt: str = ".2f") -> str:
    return f"{d['mean']:{fmt}} [{d['lo']:{fmt}}, {d['hi']:{fmt}}]"


def _sci(d: dict) -> str:
    return f"{d['mean']:+.2f} [{d['lo']:+.2f}, {d['hi']:+.2f}]"


def report_markdown(res: dict) -> str:
    """The tables of a `main` result."""
    doms = ["code", "math", "chat"]
    T = res["temperature"]
    base = res.get("baseline")
    lines = [
        "| drafter | drafts by | "
        + " | ".join(f"gamma {d}" for d in doms)
        + " | gamma all | "
        + (f"vs {base} (all, paired) |" if base else "")
        + (" exact E[gamma] all | draws - exact |" if T == 0 else ""),
        "|---|---|" + "---:|" * (len(doms) + 1 + bool(base) + 2 * (T == 0)),
    ]
    for name, r in res["rows"].items():
        cells = [_ci(r[f"gamma_{d}"]) if f"gamma_{d}" in r else "-" for d in doms + ["all"]]
        if base:
            cells.append(_sci(r["vs_base_all"]) if "vs_base_all" in r else "-")
        if T == 0:
            cells += (
                [_ci(r["exact_all"]), _sci(r["draws_minus_exact_all"])]
                if "exact_all" in r
                else ["-", "-"]
            )
        lines.append(f"| {name} | {r['spec_label']} | " + " | ".join(cells) + " |")
    if res.get("pairs"):
        lines += [
            "",
            "| paired difference | " + " | ".join(doms) + " | all |",
            "|---|" + "---:|" * 4,
        ]
        for p, d in res["pairs"].items():
            lines.append(
                f"| {p} | "
                + " | ".join(_sci(d[k]) if k in d else "-" for k in doms + ["all"])
                + " |"
            )
    r0 = next(iter(res["rows"].values()))
    lines += [
        "",
        f"{r0['anchors']} held-out anchors ({r0['sequences']} sequences), verified at T = {T:g}; "
        "95% intervals from a bootstrap over sequences, paired where two rows are compared.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m research.bound", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True, help="held-out answers (training.drafter_data)")
    ap.add_argument("--prompts", default="demo/data/test_prompts.jsonl")
    ap.add_argument("--row", type=parse_row, action="append", required=True)
    ap.add_argument("--baseline", help="row name every row is compared with (paired)")
    ap.add_argument("--pair", action="append", default=[], help="A:B: gamma(A) - gamma(B), paired")
    ap.add_argument("--temperature", type=float, default=0.0, help="the target's verification")
    ap.add_argument("--max-anchors", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, help="only the first N held-out sequences (a smoke run)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True, help="JSON result (a .md table beside it)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from drafter_service.factory import load_model, make_proposer
    from target_service.engine import TargetEngine

    seqs = heldout_sequences(args.data, args.prompts, args.target)[: args.limit]
    engine = TargetEngine(args.target, n_slots=16)
    res: dict = dict(
        temperature=args.temperature, baseline=args.baseline, rows={}, pairs={}, specs={}
    )
    runs: dict[str, Measured] = {}
    models: dict = {}
    for spec in args.row:
        t0 = time.perf_counter()
        if spec.path == "target":  # the target sampling its own T = 1 law (exact; T = 0 only)
            run = runs[spec.name] = target_sampled(engine, seqs, BLOCK_SIZE, args.max_anchors)
            row = summarize(run, runs.get(args.baseline), args.seed)
            row.update(spec_label="the target sampling at T = 1 (exact)", seconds=0.0)
            row["per_anchor"] = dict(seq=run.seq, domain=run.domain, gamma=run.gamma)
            res["rows"][spec.name] = row
            res["specs"][spec.name] = asdict(spec)
            print(f"{spec.name}: gamma {_ci(row['gamma_all'])}", flush=True)
            continue
        m = models.setdefault(spec.path, load_model(spec.path, args.target))
        prop = make_proposer(
            m,
            n_slots=16,
            max_context=engine.max_seq_len,
            greedy_estimate=spec.estimate,
            greedy_noise_scale=spec.scale,
        )
        runs[spec.name] = run = measure(
            engine, prop, seqs, spec, args.temperature, args.max_anchors, args.seed
        )
        base = runs.get(args.baseline) if spec.name != args.baseline else None
        row = summarize(run, base, args.seed)
        row["spec_label"] = spec.label()
        row["seconds"] = round(time.perf_counter() - t0, 1)
        row["per_anchor"] = dict(seq=run.seq, domain=run.domain, gamma=run.gamma, exact=run.exact)
        res["rows"][spec.name] = row
        res["specs"][spec.name] = asdict(spec)
        g = row["gamma_all"]
        print(
            f"{spec.name}: gamma {_ci(g)} ({row['anchors']} anchors, {row['seconds']} s"
            + (f", exact {_ci(row['exact_all'])}" if "exact_all" in row else "")
            + f", off reference {row['off_reference']})",
            flush=True,
        )
    for p in args.pair:
        a, _, b = p.partition(":")
        A, B = runs[a], runs[b]
        if A.seq != B.seq:
            raise ValueError(f"{a} and {b} cover different anchors")
        seq, dom = np.array(A.seq), np.array(A.domain)
        res["pairs"][f"{a} - {b}"] = {
            d: paired_bootstrap(
                np.array(A.gamma)[sel], np.array(B.gamma)[sel], seq[sel], seed=args.seed
            )
            for d in sorted(set(A.domain)) + ["all"]
            for sel in [np.ones(len(seq), bool) if d == "all" else dom == d]
        }
    res["command"] = "python -m research.bound " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    md = report_markdown(res)
    out.with_suffix(".md").write_text(md + f"\n\n```\n{res['command']}\n```\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
