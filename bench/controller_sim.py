"""The speculation controller on a simulated stack: tokens/s of auto against always drafting
the whole block (full) and never drafting (off), over drafters of several per-slot acceptances.

    python -m bench.controller_sim --seeds 6

Each run serves `--requests` greedy requests of 48 tokens one after another (concurrency 1)
from a fresh controller; a drafted slot is accepted with the given probability, independently.
The costs are the stack's at concurrency 1 with 16-token plain rounds on the 2-core VM, as the
controller's own fits saw them in one run (a verify call, a draft call, a plain round; their
proportions match bench.stack's per-round split: a plain round about 3x a drafted one). Shadow
probes are drafted beside the rounds at no cost. The module only needs `flashmap`, so it runs
against another checkout's controller too: `PYTHONPATH=OTHER python bench/controller_sim.py`.
"""

from __future__ import annotations

import argparse

import numpy as np

from flashmap.round_metadata import RoundPlan, RoundResult, SequenceRound
from flashmap.sequence import Sequence
from flashmap.speculation import ControllerConfig, SpeculationController
from flashmap.types import GenerationRequest

K = 16  # the block
VERIFY_S = (0.010, 0.00014, 0.00078)  # a verify call: fixed, per row, per drafted token
DRAFT_S = (0.0107, 0.00076)  # a draft call: fixed, per drafting request
PLAIN_S = (0.063, 0.053)  # a plain round of 16 tokens per row: fixed, per row
PREFILL_S = 0.03  # the prompt row


def simulate(policy, acceptance: float, requests: int = 30, steps: int = 16, seed: int = 0):
    """Serve `requests` greedy requests of 48 tokens. policy: a SpeculationController, "full"
    (the whole block every round) or "off". Returns (tokens per second, the share of tokens
    committed by drafted rounds)."""
    rng = np.random.default_rng(seed)
    clock = tokens = drafted_tokens = 0.0
    ctl = policy if isinstance(policy, SpeculationController) else None

    def accepted(n: int) -> int:  # leading slots accepted of n
        acc = 0
        while acc < n and rng.random() < acceptance:
            acc += 1
        return acc

    for i in range(requests):
        s = Sequence(str(i), GenerationRequest([1, 2, 3], max_new_tokens=48), K)
        while not s.finished:
            plan = ctl.plan([s]) if ctl is not None else None
            if not s.prefilled:  # the prompt row: its first token
                s.prefilled = True
                dt = PREFILL_S
                out = _result(plan, [3], rest_s=dt, seqs=[SequenceRound(s, s._append([7]), True)])
            elif (L := _length(s, plan, policy)) > 0:
                acc = accepted(L)
                s.stats.record_round(L, acc)
                new = s._append([7] * (acc + 1))
                draft_s = DRAFT_S[0] + DRAFT_S[1]
                rest_s = VERIFY_S[0] + VERIFY_S[1] + VERIFY_S[2] * L
                dt = draft_s + rest_s
                drafted_tokens += len(new)
                out = _result(
                    plan, [1 + L], 1, draft_s, rest_s, [SequenceRound(s, new, False, L, acc)]
                )
            else:
                new = s._append([7] * steps)
                dt = PLAIN_S[0] + PLAIN_S[1] if steps > 1 else sum(VERIFY_S[:2])
                out = _result(plan, [1], rest_s=dt, seqs=[SequenceRound(s, new, False)])
                out.plain_tokens = len(new)
            clock += dt
            if ctl is None:
                continue
            ctl.observe(out)
            if plan.shadow and not s.finished:
                # A shadow probe's block matches the text the target goes on to commit up to
                # its first miss.
                acc = accepted(K)
                ctl.shadow.drafted(s, len(s.tokens), np.array([7] * acc + [8] * (K - acc)))
                ctl.observe_draft(1, DRAFT_S[0] + DRAFT_S[1])
            ctl.observe_shadows([s])
        tokens += len(s.generated)
    return tokens / clock, drafted_tokens / tokens


def _length(s: Sequence, plan: RoundPlan | None, policy) -> int:
    """This round's draft length: the controller's, the whole block (full) or none (off)."""
    if plan is not None:
        return plan.of(s).draft
    return s.draft_cap() if policy == "full" else 0


def _result(plan, row_lengths, drafting=0, draft_s=0.0, rest_s=0.0, seqs=()) -> RoundResult:
    """The round as the round loop would hand it to the controller."""
    return RoundResult(plan, list(seqs), row_lengths, drafting, draft_s, rest_s=rest_s)


def controller(steps: int = 16) -> SpeculationController:
    """A fresh controller as the orchestrator builds it (pipelined: shadow probes)."""
    return SpeculationController(K, ControllerConfig(plain_tokens=steps, shadow_probes=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.controller_sim", description=__doc__)
    ap.add_argument("--acceptance", default="0.93,0.8,0.6,0.3,0.05", help="comma list")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=30)
    a = ap.parse_args(argv)
    print(
        "| per-slot acceptance | full / off | auto / max(full, off): mean (min-max) | share drafted |"
    )
    print("|---:|---:|---:|---:|")
    for p in (float(x) for x in a.acceptance.split(",")):
        ratio, best, share = [], [], []
        for seed in range(a.seeds):
            full, _ = simulate("full", p, a.requests, seed=seed)
            off, _ = simulate("off", p, a.requests, seed=seed)
            auto, drafted = simulate(controller(), p, a.requests, seed=seed)
            ratio.append(full / off)
            best.append(auto / max(full, off))
            share.append(drafted)
        print(
            f"| {p} | {np.mean(ratio):.2f} | {np.mean(best):.2f} ({min(best):.2f}-{max(best):.2f}) "
            f"| {np.mean(share):.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
