"""Mode probes: a drafter's T = 0 drafts at held-out anchors under mode-seeking variants, and
its denoiser at pure noise.

At T = 0 the target accepts slot k only when the drafted token is its argmax. A DFlash-style
drafter drafts the per-slot argmax of its marginals; a flow samples a block from its joint, so
slot k is right with about the probability the model gives the right token. The probes compare
the two ways of drafting on the same anchors:

- `--variant NAME=DIR:STEPS[,estimate=argmax][,scale=S][,sample]`: drafts at every held-out
  anchor (the same anchors and seeds as training.flow_diagnostics --max-anchors), compared
  with the reference block. With greedy held-out data (the target's own T = 0 answers) the
  accepted length at T = 0 is 1 + the matching prefix (up to floating-point near-ties; the
  --verify flag checks it with the target). `sample`: draft by sampling each slot from the
  full softmax (T = 1, all V tokens), still scored against the T = 0 reference; for a
  DFlash-style drafter it also gives the expected accepted length of independent per-slot
  sampling, 1 + sum_k prod_{j<=k} q_j(y_j). `avg=M`: the per-slot argmax of the last
  evaluation's softmax averaged over M noise draws (a mode-seeking probe, M x the cost; not a
  proposer option). `estimate=argmax` / `scale=S`: the
  FlashMapProposer's mode-seeking greedy drafting (greedy_estimate / greedy_noise_scale).
- `--tau0 NAME=DIR`: the denoiser at pure noise (tau = 0) on held-out blocks: per-slot
  accuracy of one noise draw, of the logits averaged over 16 draws, of the mean probability
  of the right token, and at a zero state; beside the DFlash-style prior (`--dflash`).

    python -m research.mode_probe --target checkpoints/demo-target --data runs/dev-greedy \
        --dflash runs/dflash-eq --variant dflash=runs/dflash-eq:1 --variant dflash-sampled=runs/dflash-eq:1,sample \
        --variant teacher=runs/flow-recipe:16 --variant teacher-argmax=runs/flow-recipe:16,estimate=argmax \
        --tau0 teacher=runs/flow-recipe --max-anchors 8 --threads 1 --out runs/diag/probe_dev.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from training.flow import noisy_state
from training.heldout import (
    anchor_rounds,
    heldout_batches,
    heldout_sequences,
    spread_anchors,
)
from training.shuffle_test import paired_bootstrap


@dataclass
class Variant:
    name: str
    path: str
    steps: int = 1
    estimate: str = "soft"
    scale: float = 1.0
    sample: bool = False
    avg: int = 1  # > 1: the per-slot argmax of the softmax averaged over this many noise draws


def _variant(text: str) -> Variant:
    name, _, rest = text.partition("=")
    parts = rest.split(",")
    path, _, steps = parts[0].partition(":")
    v = Variant(name, path, int(steps) if steps else 1)
    for p in parts[1:]:
        k, _, val = p.partition("=")
        if k == "estimate":
            v.estimate = val
        elif k == "scale":
            v.scale = float(val)
        elif k == "sample":
            v.sample = True
        elif k == "avg":
            v.avg = int(val)
        else:
            raise argparse.ArgumentTypeError(f"unknown variant option {p!r}")
    return v


@dataclass
class Drafted:
    seq: list = field(default_factory=list)
    domain: list = field(default_factory=list)
    hits: list = field(default_factory=list)  # [K] bool per anchor (vs the reference block)
    expected: list = field(default_factory=list)  # sample variants: 1 + sum_k prod q_j(y_j)
    tokens: list = field(default_factory=list)

    def gamma(self) -> np.ndarray:
        return np.array([1.0 + np.cumprod(h.astype(np.float64)).sum() for h in self.hits])


def _averaged(blocks, V: int):
    """A greedy Draft: per slot the argmax of the mean over blocks of their full-support q."""
    from flashmap.drafts import Draft

    K = len(blocks[0].tokens)
    q = np.zeros((K, V))
    for b in blocks:
        np.add.at(
            q,
            (np.arange(K)[:, None].repeat(b.support_ids.shape[1], 1), b.support_ids),
            b.support_probs,
        )
    return Draft.greedy(q.argmax(1))


@torch.no_grad()
def draft_all(
    proposer, seqs, v: Variant, max_anchors: int | None, seed: int = 0, engine=None
) -> Drafted:
    """Draft at every anchor (seeds as in training.offline_acceptance) and score the
    block against the reference continuation; with `engine`, against the target's argmax."""
    from flashmap.types import SamplingParams, VerifyRow

    K, V = proposer.block_size, proposer.vocab_size
    out = Drafted()
    n_par = proposer.n_slots if engine is None else min(proposer.n_slots, engine.n_slots)
    for g0 in range(0, len(seqs), n_par):
        group = seqs[g0 : g0 + n_par]
        anchors = [spread_anchors(s, K, max_anchors) for s in group]
        slots = [engine.allocate() for _ in group] if engine is not None else []
        try:
            for r, live, reqs in anchor_rounds(
                proposer, group, anchors, 1.0 if v.sample or v.avg > 1 else 0.0, V, seed, prefix="p"
            ):
                # The mean of the full softmax over v.avg independent draws, then its argmax.
                if v.avg > 1:
                    drafts = [
                        _averaged(blocks, V)
                        for blocks in proposer.propose_blocks(reqs, v.steps, n_blocks=v.avg)
                    ]
                else:
                    drafts = proposer.propose(reqs, v.steps)
                if engine is not None:
                    rows = [
                        VerifyRow(
                            slots[i],
                            0,
                            group[i].tokens[: anchors[i][r] + 1].tolist() + d.tokens.tolist(),
                            SamplingParams(temperature=0.0),
                            support_ids=d.tokens[:, None],
                        )
                        for i, d in zip(live, drafts)
                    ]
                    res = engine.verify(rows)
                for j, (i, d) in enumerate(zip(live, drafts)):
                    s, a = group[i], anchors[i][r]
                    ref = engine_ref = s.tokens[a + 1 : a + 1 + K]
                    if engine is not None:
                        engine_ref = np.asarray(res[j].argmax[:K])
                    out.seq.append(s.index)
                    out.domain.append(s.domain)
                    out.hits.append(d.tokens == engine_ref)
                    out.tokens.append(d.tokens)
                    if v.sample:
                        hit = d.support_ids == ref[:, None]
                        q = np.where(hit, d.support_probs, 0.0).sum(-1)
                        out.expected.append(1.0 + np.cumprod(q.astype(np.float64)).sum())
        finally:
            for sl in slots:
                engine.release(sl)
    return out


@torch.no_grad()
def tau0_table(model, prior, batches, draws: int = 16, seed: int = 0) -> dict:
    """The denoiser at pure noise (t = 0) on held-out blocks: per-slot accuracy of one noise
    draw, of the logits averaged over `draws` draws, of the mean probability given to the
    right token, at a zero state; and the prior's accuracy and mean right-token probability."""
    V = model.cfg.vocab_size
    acc = {
        k: [0.0, 0]
        for k in (
            "one_draw",
            "avg_logits",
            "avg_probs",
            "zero_state",
            "p_right",
            "prior",
            "prior_p_right",
            "agree_prior",
        )
    }
    gen = torch.Generator().manual_seed(seed)
    for b in batches:
        ctx = b.context(model)
        tt = torch.zeros(len(b.anchor))
        logits = []
        for _ in range(draws):
            x = noisy_state(b.target, tt, V, gen, shared=model.cfg.shared_noise)
            logits.append(model(x, tt, tt, b.anchor, ctx).log_softmax(-1))
        L = torch.stack(logits)  # [D, N, K, V]
        zero = model(torch.zeros(len(b.anchor), b.target.shape[1], V), tt, tt, b.anchor, ctx)
        pl = prior(None, 0.0, 1.0, b.anchor, b.context(prior)).log_softmax(-1)
        m = b.mask
        n = int(m.sum())
        right = lambda lg: float(((lg.argmax(-1) == b.target) & m).sum())  # noqa: E731
        p_true = lambda lg: float((lg.exp().gather(-1, b.target[..., None])[..., 0] * m).sum())  # noqa: E731
        for k, h in (
            ("one_draw", right(L[0])),
            ("avg_logits", right(L.mean(0))),
            ("avg_probs", right(L.exp().mean(0).log())),
            ("zero_state", right(zero)),
            ("p_right", float(np.mean([p_true(x) for x in L]))),
            ("prior", right(pl)),
            ("prior_p_right", p_true(pl)),
            ("agree_prior", float(((L[0].argmax(-1) == pl.argmax(-1)) & m).sum())),
        ):
            acc[k][0] += h
            acc[k][1] += n
    return {k: h / n for k, (h, n) in acc.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m research.mode_probe", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--target", required=True)
    ap.add_argument(
        "--data", required=True, help="held-out answers at T = 0 (training.drafter_data)"
    )
    ap.add_argument(
        "--prompts",
        default="demo/data/test_prompts.jsonl",
        help="the prompts the data were made from",
    )
    ap.add_argument("--variant", type=_variant, action="append", default=[])
    ap.add_argument(
        "--tau0", action="append", default=[], help="NAME=DIR: the denoiser at pure noise"
    )
    ap.add_argument(
        "--dflash", help="the DFlash-style prior for --tau0; the reference of paired differences"
    )
    ap.add_argument("--baseline", help="variant name the paired differences are taken against")
    ap.add_argument(
        "--pair",
        action="append",
        default=[],
        help="A:B: also the paired difference gamma(A) - gamma(B)",
    )
    ap.add_argument("--max-anchors", type=int)
    ap.add_argument(
        "--verify", action="store_true", help="score against the target's argmax (slower)"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from drafter_service.checkpoint import load_drafter
    from drafter_service.flashmap_proposer import FlashMapProposer

    seqs = heldout_sequences(args.data, args.prompts, args.target)
    engine = None
    if args.verify:
        from target_service.engine import TargetEngine

        engine = TargetEngine(args.target, n_slots=16)
    res: dict = dict(n_sequences=len(seqs), tau0={}, variants={})
    models: dict = {}
    load = lambda p: models.setdefault(p, load_drafter(p, args.target))  # noqa: E731
    if args.tau0:
        prior = load(args.dflash)
        K = prior.cfg.block_size
        batches = heldout_batches(seqs, K)
        for spec in args.tau0:
            name, _, path = spec.partition("=")
            res["tau0"][name] = tau0_table(load(path), prior, batches)
            print(
                name, json.dumps({k: round(v, 4) for k, v in res["tau0"][name].items()}), flush=True
            )
    runs = {}
    for v in args.variant:
        m = load(v.path)
        kw = (
            {}
            if m.cfg.kind == "dflash"
            else dict(greedy_estimate=v.estimate, greedy_noise_scale=v.scale)
        )
        prop = FlashMapProposer(m, n_slots=16, max_context=2048, **kw)
        runs[v.name] = d = draft_all(prop, seqs, v, args.max_anchors, engine=engine)
        seq = np.array(d.seq)
        g = d.gamma()
        hits = np.array(d.hits, np.float64)
        row = dict(
            variant=v.__dict__,
            anchors=len(seq),
            gamma=paired_bootstrap(g, clusters=seq),
            slot_acc=float(hits.mean()),
            slot_acc_k=hits.mean(0).round(4).tolist(),
        )
        for dom in sorted(set(d.domain)):
            sel = np.array(d.domain) == dom
            row[f"gamma_{dom}"] = paired_bootstrap(g[sel], clusters=seq[sel])
        if d.expected:
            row["expected_gamma"] = paired_bootstrap(np.array(d.expected), clusters=seq)
        if args.baseline and args.baseline in runs and v.name != args.baseline:
            base = runs[args.baseline]
            row["vs_baseline"] = paired_bootstrap(g, base.gamma(), seq)
            row["agree_baseline"] = float(
                np.mean([np.mean(a == b) for a, b in zip(d.tokens, base.tokens)])
            )
        row["per_anchor"] = dict(seq=seq.tolist(), gamma=g.tolist())
        res["variants"][v.name] = row
        print(
            v.name,
            f"gamma {row['gamma']['mean']:.3f} [{row['gamma']['lo']:.3f}, {row['gamma']['hi']:.3f}]",
            f"slot_acc {row['slot_acc']:.3f}",
            "expected" if d.expected else "",
            f"{row['expected_gamma']['mean']:.3f}" if d.expected else "",
            f"vs {args.baseline} {row['vs_baseline']['mean']:+.3f} [{row['vs_baseline']['lo']:+.3f}, "
            f"{row['vs_baseline']['hi']:+.3f}] agree {row['agree_baseline']:.3f}"
            if "vs_baseline" in row
            else "",
            flush=True,
        )
    res["pairs"] = {}
    for pair in args.pair:
        a, _, b = pair.partition(":")
        seq = np.array(runs[a].seq)
        res["pairs"][pair] = d = paired_bootstrap(runs[a].gamma(), runs[b].gamma(), seq)
        print(f"{a} - {b}: {d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res["command"] = "python -m research.mode_probe " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
