"""Whether a FlashMap drafter is a flow: its denoiser's accuracy against tau.

A flow's denoiser must get better as noise is removed. `denoiser_curve` gives, per tau, the
teacher denoiser's per-slot accuracy against the true block, beside what the state alone
gives (the argmax of x_t in vocabulary space, and the Bayes decoder of one slot's embedded
state y_t = x_t @ E, the best reader of that slot's y_t alone), the prior of a DFlash-style
drafter on the same blocks, that prior combined with the embedded state's exact Gaussian
likelihood (what a per-slot reader of context + state can reach), and the denoiser fed the
other kind of noise at the same t (shared <-> per slot): a shared-noise denoiser that beats
the per-slot bound reads the noise-free differences between slots, and falls back when
they are noisy. `reads_state` turns the curve into a pass / fail, and `flow_check` is the
flow stage's gate at every save (training.train_drafter).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from drafter_service.flashmap_dit import FlashMapDiT
from drafter_service.flow_time import embedded_time_knots, tau_of_t
from training.flow import Batch, noisy_state

DEFAULT_TAUS = (0.0, 0.25, 0.5, 0.75, 0.9, 0.97)


# A curve row's accuracies (`denoiser_curve`), in the order tables show them.
CURVE_KEYS = (
    "denoiser",
    "denoiser_other_noise",
    "denoiser_zero_state",
    "state_argmax",
    "state_bayes",
    "prior",
    "prior_state_bayes",
)
READS_STATE_MARGIN = 0.05  # denoiser accuracy at tau = 0.9 must beat tau = 0 by this much


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
    state of one shared draw (at t = 0 also on the zero state), of the state's own
    vocabulary-space argmax, of the embedded Bayes decoder (`EmbeddedReader`), of the `prior`
    drafter (kind dflash, one pass) and of prior + embedded likelihood. batches: training
    Batches (training.flow.Batch).
    Rows: tau, t, tau_vocab, tau_embedded (t on both maps) and the accuracies."""
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
        acc = {k: [0.0, 0] for k in CURVE_KEYS}
        for i, b in enumerate(batches):
            tt = torch.full((len(b.anchor),), t, device=E.device)
            # [N, K, V], the noise it was trained on
            x = noisy_state(b.target, tt, V, gen, shared=cfg.shared_noise)
            ctx = b.context(model)
            parts = {"denoiser": model(x, tt, tt, b.anchor, ctx), "state_argmax": x}
            # The other noise kind at the same t: does the denoiser lean on how the noise is drawn?
            if t > 0:
                x_other = noisy_state(b.target, tt, V, gen, shared=not cfg.shared_noise)
                parts["denoiser_other_noise"] = model(x_other, tt, tt, b.anchor, ctx)
            else:
                # The state that carries no noise (T = 0 drafting from the zero state): a gap to
                # "denoiser" here is what reading pure noise costs the t = 0 model.
                zero = torch.zeros_like(x)
                parts["denoiser_zero_state"] = model(zero, tt, tt, b.anchor, ctx)
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
    keys = [k for k in CURVE_KEYS if any(k in r for r in curve)]
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


# ----------------------------------------------------------------------------- the flow stage's gate

FLOW_SUMMARY = "flow_summary.json"


def flow_check(
    model: FlashMapDiT, batches: list[Batch], step: int, out: Path, prior: FlashMapDiT | None = None
) -> dict:
    """The flow stage's gate: the denoiser's accuracy against tau on `batches`
    (`denoiser_curve`), logged, and OUT/flow_summary.json rewritten with it and its history;
    a WARNING line when the denoiser does not improve with tau."""
    was = model.training
    model.eval()
    try:
        curve = denoiser_curve(model, batches, prior=prior)
    finally:
        model.train(was)
    ok = reads_state(curve)
    path = out / FLOW_SUMMARY
    old = json.loads(path.read_text()) if path.is_file() else {}
    history = [h for h in old.get("history", []) if h["step"] < step]
    history.append(
        dict(
            step=step,
            acc_tau0=accuracy_at(curve, 0.0),
            acc_tau09=accuracy_at(curve, 0.9),
            reads_state=ok,
        )
    )
    summary = dict(
        step=step,
        reads_state=ok,
        margin=READS_STATE_MARGIN,
        time_map=model.cfg.time_map,
        state_input=model.cfg.state_input,
        shared_noise=model.cfg.shared_noise,
        curve=curve,
        history=history,
    )
    if not ok:
        summary["warning"] = (
            "the denoiser does not improve with tau: it does not read its noisy state, so "
            "this is not a flow (per-slot marginals at best); do not distil it"
        )
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(path)
    print(f"\nflow check, step {step}:\n{format_curve(curve)}", flush=True)
    if not ok:
        print(
            f"WARNING: step {step}: {summary['warning']} (accuracy {accuracy_at(curve, 0.0):.3f} at tau = 0, "
            f"{accuracy_at(curve, 0.9):.3f} at tau = 0.9; {path})",
            file=sys.stderr,
            flush=True,
        )
    return summary
