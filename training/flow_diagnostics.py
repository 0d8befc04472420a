"""Diagnostics that tell whether a FlashMap drafter is a flow, and offline acceptance.

A flow's denoiser must get better as noise is removed, and one shared noise draw must
pick one coherent block. These functions measure both, for the trainer's logs, for the
controlled joint-structure task (training/joint_task.py) and, later, for `flashmap eval`:

- `denoiser_curve`: per tau the teacher denoiser's per-slot accuracy against the true
  block, beside what the state alone gives (the argmax of x_t in vocabulary space, and the
  Bayes decoder of one slot's embedded state y_t = x_t @ E, the best reader of that slot's
  y_t alone), the prior of a DFlash-style drafter on the same blocks, that prior combined
  with the embedded state's exact Gaussian likelihood (what a per-slot reader of context +
  state can reach), and the denoiser fed the other kind of noise at the same t (shared <->
  per slot): a shared-noise denoiser that beats the per-slot bound reads the noise-free
  differences between slots, and falls back when they are noisy. `reads_state` turns the
  curve into the trainer's pass / fail.
- `draft_variants`: the drafts the shuffle test and the noise diagnostics need, made by
  the serving proposer (FlashMapProposer): the block of one shared noise draw, the
  permutation shuffle (slot k from an independent shared-noise run k: every input stays in
  distribution), the per-slot-noise shuffle, and a second draw (how often the noise
  changes the block).
- `acceptance`: expected accepted length of a block given the per-slot acceptance
  probabilities, 1 + sum_k prod_{j<=k} alpha_j (rejection sampling; the +1 is the token
  the target supplies). `offline_acceptance` computes alpha with the target itself on
  held-out anchors (one verify pass per drafted block; T = 0: alpha = [d_k = argmax],
  T > 0: min(1, p/q)); `paired_bootstrap` gives 95% intervals clustered by sequence.

    python -m training.flow_diagnostics --target checkpoints/demo-target \
        --data runs/heldout-greedy --drafter runs/flow --dflash checkpoints/demo-dflash --out runs/diag.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from drafter_service.flashmap_dit import FlashMapDiT
from drafter_service.flow_time import embedded_time_knots, tau_of_t
from flashmap.types import Draft

DEFAULT_TAUS = (0.0, 0.25, 0.5, 0.75, 0.9, 0.97)
READS_STATE_MARGIN = 0.05  # denoiser accuracy at tau = 0.9 must beat tau = 0 by this much


# ----------------------------------------------------------------------------- denoiser vs tau


class EmbeddedReader:
    """The Bayes decoder of a token from one slot's embedded state y_t = (1-t) eps@E + t E_y
    (eps ~ N(0, I_V)): y_t | y ~ N(t E_y, (1-t)^2 G), G = E^T E, so the log-likelihood of
    token j is (t E_j^T G^+ y_t - t^2/2 E_j^T G^+ E_j) / (1-t)^2 + const."""

    def __init__(self, E: Tensor):
        E = E.detach().double()
        gi = torch.linalg.pinv(E.T @ E)  # [H, H]
        self.proj = (E @ gi).T.float()  # [H, V]: y -> E_j^T G^+ y
        self.lev = ((E @ gi) * E).sum(-1).float()  # [V] E_j^T G^+ E_j

    def log_likelihood(self, y: Tensor, t: float) -> Tensor:
        """y [N, K, H] at time t < 1 -> log p(y_t | token j) up to a constant, [N, K, V]."""
        score = t * (y.float() @ self.proj.to(y.device)) - 0.5 * t * t * self.lev.to(y.device)
        return score / (1 - t) ** 2


def _hits(logits: Tensor, target: Tensor, mask: Tensor) -> tuple[float, int]:
    """(correct argmaxes, counted slots) over the unmasked slots."""
    return float(((logits.argmax(-1) == target) & mask).sum()), int(mask.sum())


@torch.no_grad()
def denoiser_curve(
    model: FlashMapDiT,
    batches: list,
    taus=DEFAULT_TAUS,
    seed: int = 0,
    prior: FlashMapDiT | None = None,
    time_map: str = "own",
) -> list[dict]:
    """Per tau (under the drafter's own time map, or time_map = "vocab" / "embedded"): the
    per-slot accuracy against the true block of the denoiser (diagonal s = t) on the noisy
    state of one shared draw, of the state's own vocabulary-space argmax, of the embedded
    Bayes decoder (`EmbeddedReader`), of the `prior` drafter (kind dflash, one pass) and of
    prior + embedded likelihood. batches: training Batches (train_drafter.Batch).
    Rows: tau, t, tau_vocab, tau_embedded (t on both maps) and the accuracies."""
    from training.train_drafter import noisy_state

    cfg, V = model.cfg, model.cfg.vocab_size
    E = model.embed
    reader = EmbeddedReader(E)
    knots = (
        (cfg.time_table_t, cfg.time_table_tau)
        if cfg.time_table_t
        else embedded_time_knots(E, samples=4096)
    )
    if time_map == "own":
        t_of = lambda tau: float(model.t_of_tau(tau))  # noqa: E731
    elif time_map == "vocab":
        from drafter_service.flow_time import t_of_tau

        t_of = lambda tau: float(t_of_tau(tau, V))  # noqa: E731
    elif time_map == "embedded":
        t_of = lambda tau: float(np.interp(tau, knots[1], knots[0]))  # noqa: E731
    else:
        raise ValueError(f"time_map must be own, vocab or embedded, got {time_map!r}")
    prior_logits = []
    if prior is not None:
        for b in batches:
            prior_logits.append(prior(None, 0.0, 1.0, b.anchor, b.context(prior)).log_softmax(-1))
    rows = []
    for tau in taus:
        t = min(t_of(tau), 1 - 1e-6)
        gen = torch.Generator(device=E.device).manual_seed(seed)
        acc = {
            k: [0.0, 0]
            for k in (
                "denoiser",
                "denoiser_other_noise",
                "state_argmax",
                "state_bayes",
                "prior",
                "prior_state_bayes",
            )
        }
        for i, b in enumerate(batches):
            tt = torch.full((len(b.anchor),), t, device=E.device)
            x = noisy_state(
                b.target, tt, V, gen, shared=cfg.shared_noise
            )  # [N, K, V], the noise it was trained on
            ctx = b.context(model)
            parts = {"denoiser": model(x, tt, tt, b.anchor, ctx), "state_argmax": x}
            if (
                t > 0
            ):  # the other noise kind at the same t: does the denoiser lean on how the noise is drawn?
                x_other = noisy_state(b.target, tt, V, gen, shared=not cfg.shared_noise)
                parts["denoiser_other_noise"] = model(x_other, tt, tt, b.anchor, ctx)
            ll = reader.log_likelihood(model.embed_state(x), t)  # [N, K, V]
            parts["state_bayes"] = ll
            if prior is not None:
                parts["prior"] = prior_logits[i]
                parts["prior_state_bayes"] = prior_logits[i] + ll
            for k, logits in parts.items():
                h, n = _hits(logits, b.target, b.mask)
                acc[k][0] += h
                acc[k][1] += n
        row = dict(
            tau=float(tau),
            t=t,
            tau_vocab=float(tau_of_t(t, V)),
            tau_embedded=float(np.interp(t, knots[0], knots[1])),
        )
        row.update({k: (h / n if n else float("nan")) for k, (h, n) in acc.items() if n})
        rows.append(row)
    return rows


def time_map_table(E: Tensor, taus=(0.1, 0.5, 0.9, 0.97, 0.99), samples: int = 16384) -> list[dict]:
    """Where the vocabulary map puts its tau, and what the embedded state tells there: per
    vocab-space tau, t, the state's argmax accuracy in vocabulary space (what tau_vocab
    counts) and the Bayes decoder's accuracy from one slot's embedded state (P_E, tokens
    uniform), and the t at which the embedded map reaches the same tau."""
    from drafter_service.flow_time import (
        correct_decode_prob,
        critical_snr,
        embedded_decode_prob,
        t_of_tau,
    )

    V = E.shape[0]
    crit = critical_snr(E, samples)
    t_k, tau_k = embedded_time_knots(E, samples=samples)
    rows = []
    for tau in taus:
        t = float(t_of_tau(tau, V))
        rows.append(
            dict(
                tau=float(tau),
                t_vocab=t,
                p_vocab=float(correct_decode_prob(np.array(t), V)),
                p_embedded=float(embedded_decode_prob(np.array(t), E, critical=crit)),
                t_embedded=float(np.interp(tau, tau_k, t_k)),
            )
        )
    return rows


def accuracy_at(curve: list[dict], tau: float, key: str = "denoiser") -> float:
    """The curve's `key` at the row whose tau is nearest to `tau`."""
    return min(curve, key=lambda r: abs(r["tau"] - tau))[key]


def reads_state(curve: list[dict], margin: float = READS_STATE_MARGIN) -> bool:
    """Whether the denoiser improves with tau: accuracy at tau ~0.9 >= accuracy at tau 0 +
    margin. A denoiser that ignores its state is flat."""
    return accuracy_at(curve, 0.9) >= accuracy_at(curve, 0.0) + margin


def format_curve(curve: list[dict]) -> str:
    """A plain-text table of a `denoiser_curve`."""
    keys = [
        k
        for k in (
            "denoiser",
            "denoiser_other_noise",
            "state_argmax",
            "state_bayes",
            "prior",
            "prior_state_bayes",
        )
        if k in curve[-1]
    ]
    head = f"{'tau':>5} {'t':>7} {'tau_voc':>7} {'tau_emb':>7} " + " ".join(
        f"{k:>17}" for k in keys
    )
    lines = [head]
    for r in curve:
        lines.append(
            f"{r['tau']:5.2f} {r['t']:7.4f} {r['tau_vocab']:7.3f} {r['tau_embedded']:7.3f} "
            + " ".join(f"{r.get(k, float('nan')):17.3f}" for k in keys)
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- drafts


@dataclass
class DraftVariants:
    """Drafts of one request under the noise variants (see `draft_variants`)."""

    shared: Draft  # one shared noise draw (what serving drafts)
    perm: Draft  # slot k from an independent shared-noise run k
    other: Draft  # a second, independent shared-noise draw
    slot_noise: Draft | None = None  # one pass with an independent draw per slot
    runs: list[Draft] | None = None  # the K independent shared-noise runs behind perm


def cyclic_shuffles(blocks: list[Draft]) -> list[Draft]:
    """The K permutation shuffles j = 0..K-1 that take slot k from run (k + j) mod K: each is a
    valid shuffle (every slot from another independent run), and together with the K runs
    themselves they estimate Delta with the draws' own noise averaged out (Rao-Blackwell)."""
    K = len(blocks[0].tokens)
    return [permutation_shuffle(blocks[j:K] + blocks[:j]) for j in range(K)]


def permutation_shuffle(blocks: list[Draft]) -> Draft:
    """Slot k of block k (K independent runs -> one block)."""
    K = len(blocks[0].tokens)
    if len(blocks) < K:
        raise ValueError(f"the permutation shuffle needs {K} blocks, got {len(blocks)}")
    S = max(b.support_ids.shape[1] for b in blocks)
    ids = np.full((K, S), -1, np.int64)
    probs = np.zeros((K, S), np.float32)
    for k in range(K):
        s = blocks[k].support_ids.shape[1]
        ids[k, :s], probs[k, :s] = blocks[k].support_ids[k], blocks[k].support_probs[k]
    return Draft(np.array([blocks[k].tokens[k] for k in range(K)], np.int64), ids, probs)


def draft_variants(
    proposer, requests: list, steps: int, slot_noise: bool = True
) -> list[DraftVariants]:
    """For each request (drafter_service.proposer.ProposeRequest): the shared-noise block
    (= proposer.propose), the permutation shuffle and a second draw from K independent
    shared-noise runs (propose_blocks), and with slot_noise the block of one pass with an
    independent draw per slot (the proposer's shared_noise switched off for that call)."""
    K = proposer.block_size
    runs = proposer.propose_blocks(requests, steps, n_blocks=K)
    indep = [None] * len(requests)
    if slot_noise:
        was = proposer.shared_noise
        proposer.shared_noise = False
        try:
            indep = proposer.propose(requests, steps)
        finally:
            proposer.shared_noise = was
    return [
        DraftVariants(r[0], permutation_shuffle(r), r[1], s, list(r)) for r, s in zip(runs, indep)
    ]


def acceptance(alpha: np.ndarray) -> float:
    """Expected accepted length 1 + sum_k prod_{j<=k} alpha_j for per-slot acceptance
    probabilities alpha [K] (each given the earlier slots accepted)."""
    return 1.0 + float(np.cumprod(np.asarray(alpha, np.float64)).sum())


def proposal_prob(draft: Draft) -> np.ndarray:
    """q_k(d_k) per slot [K] (1 for greedy drafts)."""
    hit = draft.support_ids == draft.tokens[:, None]
    return np.where(hit, draft.support_probs, 0.0).sum(-1)


# ----------------------------------------------------------------------------- statistics


def paired_bootstrap(
    a: np.ndarray,
    b: np.ndarray | None = None,
    clusters: np.ndarray | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> dict:
    """Mean of a (or of a - b, paired) with a percentile bootstrap interval; resampling whole
    clusters (e.g. the anchors of one sequence) when given. Returns mean, lo, hi, n."""
    d = np.asarray(a, np.float64) - (0.0 if b is None else np.asarray(b, np.float64))
    cl = np.arange(len(d)) if clusters is None else np.asarray(clusters)
    ids, inv = np.unique(cl, return_inverse=True)
    sums, counts = np.bincount(inv, weights=d), np.bincount(inv)
    g = np.random.default_rng(seed)
    pick = g.integers(0, len(ids), (n_boot, len(ids)))
    boot = sums[pick].sum(1) / counts[pick].sum(1)
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return dict(mean=float(d.mean()), lo=float(lo), hi=float(hi), n=int(len(d)))


# ----------------------------------------------------------------------------- held-out anchors

SELECTION = range(
    10, 26
)  # per-domain prompt indices for choosing settings (the timed eval uses 0..9)


@dataclass
class HeldoutSequence:
    """One held-out prompt answered by the target, with the target's features."""

    index: int  # line order in the prompt file (= order in the data directory)
    domain: str
    domain_index: int  # its position among its domain's prompts
    tokens: np.ndarray  # [L] int64 prompt + response
    features: np.ndarray  # [L, F] float32
    prompt_len: int

    def anchors(self, block_size: int) -> range:
        """Anchor positions with a full reference block after them (the first: the first
        response token, its context the whole prompt, as when serving)."""
        return range(self.prompt_len, len(self.tokens) - block_size)


def heldout_sequences(
    data_dir: str | Path,
    prompts: str | Path,
    target_dir: str | Path | None = None,
    exclude=SELECTION,
    domains: tuple[str, ...] | None = None,
    only=None,
) -> list[HeldoutSequence]:
    """The sequences of a drafter data directory made from `prompts` (training.drafter_data on
    a held-out prompt file), without those whose per-domain index is in `exclude` (default:
    the selection prompts 11-26 of each domain); with `only`, just those per-domain indices
    (only=SELECTION, exclude=(): the selection prompts)."""
    from flashmap.prompts import read_prompt_lines
    from training.drafter_data import list_shards, read_shard

    lines = read_prompt_lines(prompts, target_dir)
    seqs = [s for path in list_shards(data_dir) for s in read_shard(path)]
    if len(seqs) != len(lines):
        raise ValueError(
            f"{data_dir} holds {len(seqs)} sequences, {prompts} has {len(lines)} prompts"
        )
    out, seen = [], {}
    for i, ((_, rec, ids), s) in enumerate(zip(lines, seqs)):
        dom = str(rec.get("domain", "all"))
        j = seen[dom] = seen.get(dom, -1) + 1
        if list(s.tokens[: len(ids)].tolist()) != list(ids):
            raise ValueError(
                f"{data_dir}: sequence {i} does not start with prompt {i} of {prompts}"
            )
        if j in exclude or (only is not None and j not in only) or (domains and dom not in domains):
            continue
        out.append(
            HeldoutSequence(
                i,
                dom,
                j,
                s.tokens.numpy().astype(np.int64),
                s.features.float().numpy(),
                int(s.prompt_len),
            )
        )
    return out


@dataclass
class AnchorDrafts:
    """Per anchor: its sequence, expected accepted length per draft variant, the drafted
    tokens of the shared-noise block and the share of slots a second draw changes."""

    seq: np.ndarray  # [N] sequence index (the bootstrap's clusters)
    domain: list = field(default_factory=list)
    gamma: dict = field(default_factory=dict)  # variant -> [N]
    tokens: list = field(default_factory=list)  # [N] arrays [K]
    changed: np.ndarray | None = None  # [N]


def _alpha(res, draft: Draft, temperature: float) -> np.ndarray:
    """Per-slot acceptance probability [K] from a target VerifyResult of this draft."""
    if temperature == 0:
        return (draft.tokens == res.argmax[: len(draft.tokens)]).astype(np.float64)
    hit = draft.support_ids == draft.tokens[:, None]  # [K, S]
    p = np.where(hit, res.support_probs, 0.0).sum(-1)
    return np.minimum(1.0, p / np.maximum(proposal_prob(draft), 1e-12))


def spread_anchors(s: HeldoutSequence, block_size: int, max_anchors: int | None) -> list[int]:
    """The sequence's anchors, at most max_anchors of them spread evenly."""
    a = list(s.anchors(block_size))
    if max_anchors and len(a) > max_anchors:
        a = [a[int(i)] for i in np.linspace(0, len(a) - 1, max_anchors).round()]
    return a


def anchor_rounds(
    proposer,
    group: list[HeldoutSequence],
    anchors: list[list[int]],
    temperature: float,
    top_m: int,
    seed: int,
    prefix: str = "h",
):
    """Walk a group of held-out sequences anchor by anchor: per round r yields (r, live, requests),
    live the indices into group that still have an anchor and one ProposeRequest each, the
    proposer's context extended up to that anchor. Seeds depend on (seed, sequence, anchor)
    only, so two drafters see the same draws. The sequences leave the proposer at the end."""
    from flashmap.types import ProposeRequest

    names = [f"{prefix}{s.index}" for s in group]
    have = [0] * len(group)  # context positions given to the proposer so far
    try:
        for r in range(max(len(a) for a in anchors)):
            live = [i for i, a in enumerate(anchors) if r < len(a)]
            reqs = []
            for i in live:
                s, a = group[i], anchors[i][r]
                if a > have[i]:
                    proposer.extend(names[i], s.tokens[have[i] : a], s.features[have[i] : a])
                    have[i] = a
                reqs.append(
                    ProposeRequest(
                        names[i],
                        int(s.tokens[a]),
                        temperature=float(temperature),
                        top_m=top_m,
                        seed=int(np.random.SeedSequence([seed, s.index, a]).generate_state(1)[0]),
                    )
                )
            yield r, live, reqs
    finally:
        for n in names:
            proposer.release(n)


@torch.no_grad()
def offline_acceptance(
    engine,
    proposer,
    seqs: list[HeldoutSequence],
    *,
    temperature: float = 0.0,
    steps: int = 1,
    top_m: int = 4,
    shuffles: bool = True,
    max_anchors: int | None = None,
    seed: int = 0,
    progress: bool = False,
    averaged: bool = False,
) -> AnchorDrafts:
    """Draft a block at every anchor of seqs with `proposer` (the serving FlashMapProposer or
    any SlotCacheProposer; context = the target's features of the reference tokens before the
    anchor) and verify it with the target `engine` (TargetEngine): alpha_k = [d_k = argmax]
    at T = 0, min(1, p_k(d_k) / q_k(d_k)) at T > 0, along the drafted block. Variants (with
    `shuffles`): "shared" (what serving drafts), "perm" (permutation shuffle), "slot_noise"
    (per-slot noise); gamma per variant is 1 + sum_k prod_{j<=k} alpha_j. Seeds depend on
    (seed, sequence, anchor) only, so two drafters see the same draws. max_anchors: at most
    this many anchors per sequence, spread evenly. averaged (with shuffles): also "shared_avg"
    and "perm_avg", gamma averaged over all K shared-noise runs and over their K cyclic
    shuffles (2K - 2 more verifies per anchor, no more drafting): the same Delta in expectation,
    without the noise of one draw per anchor."""
    from tqdm import tqdm

    from flashmap.types import SamplingParams, VerifyRow

    K = proposer.block_size
    n_par = min(engine.n_slots, proposer.n_slots)
    params = SamplingParams(temperature=float(temperature))
    out = AnchorDrafts(seq=np.zeros(0, np.int64))
    seq_ids, gam, changed = [], {}, []
    bar = tqdm(total=len(seqs), disable=not progress, desc="anchors")
    for g0 in range(0, len(seqs), n_par):
        group = seqs[g0 : g0 + n_par]
        anchors = [spread_anchors(s, K, max_anchors) for s in group]
        slots = [engine.allocate() for _ in group]
        ref_kv = [0] * len(
            group
        )  # leading positions of the engine's cache that hold reference tokens
        try:
            for r, live, reqs in anchor_rounds(proposer, group, anchors, temperature, top_m, seed):
                if shuffles and getattr(proposer.model.cfg, "kind", "") == "flashmap":
                    variants = draft_variants(proposer, reqs, steps)
                else:  # drafts that ignore the noise: every variant is the same block
                    variants = [DraftVariants(d, d, d, d) for d in proposer.propose(reqs, steps)]
                kinds = ("shared", "perm", "slot_noise") if shuffles else ("shared",)
                blocks = {k: [getattr(v, k) for v in variants] for k in kinds}
                if averaged and shuffles and variants[0].runs is not None:
                    cyc = [cyclic_shuffles(v.runs) for v in variants]
                    for j in range(
                        1, K
                    ):  # run 0 is "shared" and its shuffle 0 is "perm", verified above
                        blocks[f"run{j}"] = [v.runs[j] for v in variants]
                        blocks[f"cyc{j}"] = [c[j] for c in cyc]
                for kind, ds in blocks.items():
                    rows = []
                    for i, d in zip(live, ds):
                        s, a = group[i], anchors[i][r]
                        start = min(
                            a, ref_kv[i]
                        )  # the cache past it holds drafts of an earlier anchor
                        rows.append(
                            VerifyRow(
                                slots[i],
                                start,
                                np.concatenate([s.tokens[start : a + 1], d.tokens]),
                                params,
                                support_ids=d.support_ids,
                            )
                        )
                    res = engine.verify(rows)
                    for d, rr in zip(ds, res):
                        gam.setdefault(kind, []).append(acceptance(_alpha(rr, d, temperature)))
                for i in live:
                    ref_kv[i] = (
                        anchors[i][r] + 1
                    )  # the anchor is reference; the positions after it, drafts
                for i, v in zip(live, variants):
                    seq_ids.append(group[i].index)
                    out.domain.append(group[i].domain)
                    out.tokens.append(v.shared.tokens)
                    changed.append(float(np.mean(v.shared.tokens != v.other.tokens)))
        finally:
            for sl in slots:
                engine.release(sl)
        bar.update(len(group))
    bar.close()
    out.seq = np.array(seq_ids, np.int64)
    out.gamma = {k: np.array(v) for k, v in gam.items() if not k.startswith(("run", "cyc"))}
    if "run1" in gam:
        out.gamma["shared_avg"] = np.mean(
            [gam["shared"]] + [gam[f"run{j}"] for j in range(1, K)], 0
        )
        out.gamma["perm_avg"] = np.mean([gam["perm"]] + [gam[f"cyc{j}"] for j in range(1, K)], 0)
    out.changed = np.array(changed)
    return out


def agreement(a: AnchorDrafts, b: AnchorDrafts) -> float:
    """Share of drafted slots where two drafters' shared-noise blocks agree (same anchors)."""
    if len(a.tokens) != len(b.tokens):
        raise ValueError("the two drafts cover different anchors")
    return float(np.mean([np.mean(x == y) for x, y in zip(a.tokens, b.tokens)]))


def heldout_batches(
    seqs: list[HeldoutSequence],
    block_size: int,
    n_batches: int = 8,
    seqs_per_batch: int = 8,
    anchors_per_seq: int = 8,
    seed: int = 0,
) -> list:
    """Training-style Batches of held-out blocks (for `denoiser_curve`)."""
    from training.drafter_data import Sequence
    from training.train_drafter import make_batch

    rng = np.random.default_rng(seed)
    pool = [
        Sequence(torch.from_numpy(s.tokens), torch.from_numpy(s.features), s.prompt_len)
        for s in seqs
        if len(s.anchors(block_size))
    ]
    out = []
    for _ in range(n_batches):
        pick = rng.choice(len(pool), size=min(seqs_per_batch, len(pool)), replace=False)
        out.append(make_batch([pool[i] for i in pick], block_size, anchors_per_seq, 1 << 30, rng))
    return out


# ----------------------------------------------------------------------------- one call for eval / CLI


@dataclass
class DrafterSpec:
    name: str
    path: str
    steps: tuple[int, ...] = (1,)
    greedy_estimate: str = (
        "soft"  # FlashMapProposer's drafting of T = 0 rows ("argmax": mode-seeking)
    )
    greedy_noise_scale: float = 1.0


def diagnose(
    target: str | Path,
    data: str | Path,
    prompts: str | Path,
    drafters: list[DrafterSpec],
    dflash: str | Path | None = None,
    temperatures: tuple[float, ...] = (0.0,),
    *,
    max_anchors: int | None = None,
    domains: tuple[str, ...] | None = None,
    curve: bool = True,
    device: str = "cpu",
    progress: bool = False,
    seed: int = 0,
    selection: bool = False,
    averaged: bool = False,
) -> dict:
    """Everything this module measures, on the held-out anchors of `data` (training.drafter_data
    run on `prompts` with the target; the selection prompts are left out): per FlashMap
    drafter its denoiser curve (with the DFlash-style drafter as the prior), and per drafter,
    step count and temperature the offline acceptance (shared noise, permutation and per-slot
    shuffles, by domain), the share of slots a second draw changes, agreement with the
    DFlash-style drafter and paired bootstrap differences against it. selection: measure on
    the selection prompts (11-26 of each domain) instead, to choose settings. averaged: Delta
    also from all K runs and their K cyclic shuffles (offline_acceptance)."""
    from drafter_service.checkpoint import load_drafter
    from drafter_service.flashmap_proposer import FlashMapProposer
    from target_service.engine import TargetEngine

    seqs = (
        heldout_sequences(data, prompts, target, exclude=(), only=SELECTION, domains=domains)
        if selection
        else heldout_sequences(data, prompts, target, domains=domains)
    )
    engine = TargetEngine(target, n_slots=16, device=device)
    K = None
    base = load_drafter(dflash, target, device=device) if dflash else None
    models = {d.name: load_drafter(d.path, target, device=device) for d in drafters}
    res: dict = dict(n_sequences=len(seqs), selection=selection, curves={}, acceptance=[])
    runs: dict = {}
    for name, m in [("dflash", base)] * (base is not None) + list(models.items()):
        K = m.cfg.block_size
        spec = next((d for d in drafters if d.name == name), DrafterSpec(name, ""))
        steps = (1,) if m.cfg.kind == "dflash" else spec.steps
        prop = FlashMapProposer(
            m,
            n_slots=16,
            max_context=engine.max_seq_len,
            device=device,
            greedy_estimate=spec.greedy_estimate,
            greedy_noise_scale=spec.greedy_noise_scale,
        )
        for T in temperatures:
            for n in steps:
                runs[(name, n, T)] = offline_acceptance(
                    engine,
                    prop,
                    seqs,
                    temperature=T,
                    steps=n,
                    max_anchors=max_anchors,
                    seed=seed,
                    progress=progress,
                    averaged=averaged,
                )
        if curve and m.cfg.kind == "flashmap":
            res["curves"][name] = denoiser_curve(m, heldout_batches(seqs, K, seed=seed), prior=base)
    for (name, n, T), a in runs.items():
        row = dict(
            drafter=name,
            steps=n,
            temperature=T,
            anchors=len(a.seq),
            noise_changes=float(a.changed.mean()),
        )
        doms = sorted(set(a.domain))
        dom = np.array(a.domain)
        for d in doms + ["all"]:
            sel = np.ones(len(dom), bool) if d == "all" else dom == d
            row[f"gamma_{d}"] = paired_bootstrap(
                a.gamma["shared"][sel], clusters=a.seq[sel], seed=seed
            )
            for v in ("perm", "slot_noise"):
                if v in a.gamma:
                    row[f"delta_{v}_{d}"] = paired_bootstrap(
                        a.gamma["shared"][sel], a.gamma[v][sel], a.seq[sel], seed=seed
                    )
            if "perm_avg" in a.gamma:
                row[f"avg_gamma_{d}"] = paired_bootstrap(
                    a.gamma["shared_avg"][sel], clusters=a.seq[sel], seed=seed
                )
                row[f"delta_perm_avg_{d}"] = paired_bootstrap(
                    a.gamma["shared_avg"][sel], a.gamma["perm_avg"][sel], a.seq[sel], seed=seed
                )
            ref = runs.get(("dflash", 1, T))
            if ref is not None and name != "dflash":
                row[f"vs_dflash_{d}"] = paired_bootstrap(
                    a.gamma["shared"][sel], ref.gamma["shared"][sel], a.seq[sel], seed=seed
                )
        if ("dflash", 1, T) in runs and name != "dflash":
            row["agree_dflash"] = agreement(a, runs[("dflash", 1, T)])
        res["acceptance"].append(row)
    return res


def _ci(d: dict) -> str:
    return f"{d['mean']:.3f} [{d['lo']:.3f}, {d['hi']:.3f}]"


def report_markdown(res: dict) -> str:
    """Tables of a `diagnose` result."""
    lines = []
    for name, curve in res["curves"].items():
        lines += [
            f"Denoiser of `{name}` against tau (its own time map), per-slot accuracy:",
            "",
            "```",
            format_curve(curve),
            "```",
            "",
        ]
    rows = res["acceptance"]
    if rows:
        doms = sorted(
            {k[len("gamma_") :] for r in rows for k in r if k.startswith("gamma_")} - {"all"}
        ) + ["all"]
        lines += [
            "| drafter | steps | T | "
            + " | ".join(f"gamma {d}" for d in doms)
            + " | Delta perm (all) | Delta perm, K draws averaged (all) | Delta per-slot noise (all) "
            "| vs DFlash (all) | slots a new draw changes | agrees with DFlash |",
            "|---|---:|---:|" + "---:|" * (len(doms) + 6),
        ]
        for r in rows:
            cell = lambda k: _ci(r[k]) if k in r else "-"  # noqa: E731
            lines.append(
                f"| {r['drafter']} | {r['steps']} | {r['temperature']:g} | "
                + " | ".join(cell(f"gamma_{d}") for d in doms)
                + f" | {cell('delta_perm_all')} | {cell('delta_perm_avg_all')} | {cell('delta_slot_noise_all')} "
                f"| {cell('vs_dflash_all')} "
                f"| {r['noise_changes']:.3f} | {r.get('agree_dflash', float('nan')):.3f} |"
            )
        avg = [r for r in rows if "delta_perm_avg_all" in r]
        if avg:
            lines += [
                "",
                "Delta perm per domain (K draws averaged):",
                "",
                "| drafter | steps | T | " + " | ".join(doms) + " |",
                "|---|---:|---:|" + "---:|" * len(doms),
            ]
            lines += [
                f"| {r['drafter']} | {r['steps']} | {r['temperature']:g} | "
                + " | ".join(_ci(r[f"delta_perm_avg_{d}"]) for d in doms)
                + " |"
                for r in avg
            ]
        lines += [
            "",
            f"{rows[0]['anchors']} held-out anchors per row ({res['n_sequences']} sequences); 95% "
            "intervals from a bootstrap over sequences, paired where two rows are compared.",
            "",
        ]
    return "\n".join(lines)


def _spec(text: str) -> DrafterSpec:
    """NAME=DIR[:STEPS,...[:ESTIMATE[:NOISE_SCALE]]] -> DrafterSpec (ESTIMATE, NOISE_SCALE: the
    proposer's greedy_estimate / greedy_noise_scale for T = 0 drafts)."""
    name, _, rest = text.partition("=")
    path, *more = rest.split(":")
    if not name or not path or len(more) > 3:
        raise argparse.ArgumentTypeError(
            f"expected NAME=DIR[:STEPS,...[:ESTIMATE[:NOISE_SCALE]]], got {text!r}"
        )
    steps = tuple(int(x) for x in more[0].split(",")) if more and more[0] else (1,)
    return DrafterSpec(name, path, steps, *(more[1:2] or ["soft"]), *[float(x) for x in more[2:3]])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m training.flow_diagnostics", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", help="training.drafter_data output for --prompts (held-out answers)")
    ap.add_argument("--prompts", default="training/data/heldout_prompts.jsonl")
    ap.add_argument(
        "--drafter",
        type=_spec,
        action="append",
        default=[],
        help="NAME=DIR[:STEPS,...[:ESTIMATE[:NOISE_SCALE]]] (repeatable; ESTIMATE soft|argmax and "
        "NOISE_SCALE: how T = 0 blocks are drafted, FlashMapProposer greedy_estimate / "
        "greedy_noise_scale)",
    )
    ap.add_argument(
        "--dflash", help="DFlash-style checkpoint: the baseline, prior and agreement reference"
    )
    ap.add_argument("--temperature", type=float, action="append", help="repeatable (default 0)")
    ap.add_argument("--max-anchors", type=int, help="at most this many anchors per sequence")
    ap.add_argument("--domain", action="append", help="only these domains (repeatable)")
    ap.add_argument("--no-curve", action="store_true")
    ap.add_argument(
        "--selection",
        action="store_true",
        help="the selection prompts (11-26 of each domain) instead of the held-out rest",
    )
    ap.add_argument(
        "--time-maps",
        action="store_true",
        help="only print where the vocabulary map puts tau and what the embedded state tells there",
    )
    ap.add_argument(
        "--averaged",
        action="store_true",
        help="Delta also averaged over all K shared-noise runs and their K cyclic shuffles "
        "(2K - 2 more target verifies per anchor)",
    )
    ap.add_argument("--out", help="JSON result (a .md table beside it)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.time_maps:
        from target_service.checkpoint import load_embeddings

        print(
            f"{'tau':>5} {'t (vocab map)':>14} {'P argmax x_t':>13} {'P Bayes y_t':>12} {'t (embedded map)':>17}"
        )
        for r in time_map_table(load_embeddings(args.target)[0].float()):
            print(
                f"{r['tau']:5.2f} {r['t_vocab']:14.4f} {r['p_vocab']:13.3f} {r['p_embedded']:12.3f} "
                f"{r['t_embedded']:17.4f}"
            )
        return 0
    if not args.out or not args.data:
        ap.error("--data and --out are required (but for --time-maps)")
    try:
        res = diagnose(
            args.target,
            args.data,
            args.prompts,
            args.drafter,
            args.dflash,
            tuple(args.temperature or [0.0]),
            max_anchors=args.max_anchors,
            domains=tuple(args.domain) if args.domain else None,
            curve=not args.no_curve,
            device=args.device,
            progress=True,
            selection=args.selection,
            averaged=args.averaged,
        )
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    md = report_markdown(res)
    out.with_suffix(".md").write_text(
        md
        + "\n```\npython -m training.flow_diagnostics "
        + " ".join(argv if argv is not None else sys.argv[1:])
        + "\n```\n"
    )
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
