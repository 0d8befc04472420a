"""Drafters against the target alone in one process: paired speed at T = 0.

The quick counterpart of `flashmap eval`'s speed columns, for trying drafters and their
settings on one prompt set: held-out prompts of a domain (with request seeds as in
`flashmap eval`) or random token ids. A method is NAME:SOURCE[:STEPS[:MIN_CONFIDENCE]], SOURCE
being a checkpoint directory, `init` (an untrained FlashMap drafter: the real drafting cost,
near-zero acceptance) or `oracle@RATE` (the target's own greedy continuation with each slot
corrupted with probability RATE: acceptance dialled in, drafting almost free).

Timing (`flashmap.measure.run_paired`): every prompt is decoded by every method back to back,
in a rotating order, `--repeats` times; each method keeps its fastest run per prompt, and the
speedup is the ratio of the summed fastest times, with a 95% bootstrap interval over the
prompts (equal tokens at T = 0: the outputs are asserted identical). Per method also the mean
acceptance length and, per round, the drafting and verify milliseconds.

    python -m bench.drafters --domain code --prompts 10 --repeats 5 --compile \\
        --methods flashmap-1:checkpoints/demo-flashmap dflash:checkpoints/demo-dflash
    python -m bench.drafters --domain random --prompts 4 --max-new-tokens 96 --append \\
        --methods oracle-0:oracle@0 oracle-0.15:oracle@0.15 untrained:init

Writes a section per run into the report (`--append` adds it to the ones there).
"""

from __future__ import annotations

import datetime
import sys

import numpy as np

from bench.common import RESULTS, bootstrap_ratio, fmt_ci, parser, set_threads, stamp

DOMAINS = ("code", "math", "chat", "random")
TITLE = "# Drafters against the target alone (in process, CPU)"


def parse_method(spec: str) -> tuple[str, str, int, float]:
    """NAME:SOURCE[:STEPS[:MIN_CONFIDENCE]] -> (name, source, steps, min_confidence)."""
    name, source, *rest = spec.split(":")
    return name, source, int(rest[0]) if rest else 1, float(rest[1]) if len(rest) > 1 else 0.0


def domain_prompts(target: str, domain: str, n: int, offset: int, vocab: int) -> list[dict]:
    """Held-out prompts of a domain, or random token ids (8-31 tokens), as flashmap eval's
    prompt records ({"id", "ids"})."""
    if domain == "random":
        rng = np.random.default_rng(0)
        ids = [rng.integers(3, vocab, int(rng.integers(8, 32))).tolist() for _ in range(offset + n)]
        return [{"id": f"random-{i}", "ids": p} for i, p in enumerate(ids)][offset:]
    from flashmap.prompts import TEST_PROMPTS, read_domain_prompts

    prompts = [p for p in read_domain_prompts(TEST_PROMPTS, target) if p["domain"] == domain]
    return prompts[offset : offset + n]


def proposer_for(source, target, engine, steps, min_conf, compile_, references):
    if source.startswith("oracle@"):
        from drafter_service.oracle import OracleProposer

        rate = float(source.split("@", 1)[1])
        return OracleProposer(references, 16, engine.vocab_size, error_rate=rate, seed=1)
    from drafter_service.factory import load_model, make_proposer

    return make_proposer(
        load_model(source, target),
        n_slots=1,
        max_context=engine.max_seq_len,
        steps=steps,
        min_confidence=min_conf,
        compile=compile_,
    )


def table(runs: dict) -> list[str]:
    base = runs["target alone"]
    lines = [
        "| method | gamma | tokens/s | speedup [95% CI] | draft ms / round | verify ms / round |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for m, r in runs.items():
        gamma = f"{r['gamma']:.2f}" if r["drafts"] else "-"
        speedup = bootstrap_ratio(base["prompt_walls"], r["prompt_walls"])
        rounds = max(r["rounds"], 1)
        lines.append(
            f"| {m} | {gamma} | {r['tokens'] / r['wall_s']:.1f} | {fmt_ci(speedup)}x | "
            f"{1e3 * r['draft_s'] / rounds:.2f} | {1e3 * r['verify_s'] / rounds:.2f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = parser(
        "bench.drafters",
        __doc__,
        target=None,
        max_new_tokens=64,
        prompts=10,
        repeats=5,
        threads=2,
        out=RESULTS / "bench_drafters.md",
    )
    ap.add_argument(
        "--methods", nargs="+", required=True, help="NAME:SOURCE[:STEPS[:MIN_CONFIDENCE]]"
    )
    ap.add_argument("--domain", default="code", choices=DOMAINS)
    ap.add_argument(
        "--offset",
        type=int,
        default=0,
        help="skip the first M prompts (flashmap eval uses the first 10: tune on the others)",
    )
    ap.add_argument(
        "--compile", action="store_true", help="torch.compile every drafter (enable_compile)"
    )
    ap.add_argument("--append", action="store_true", help="add a section to the report")
    a = ap.parse_args(argv)
    methods = [parse_method(s) for s in a.methods]
    threads = set_threads(a.threads)

    from flashmap.measure import run_paired, run_prompts
    from flashmap_cli.stack import default_checkpoints
    from target_service.engine import TargetEngine

    target, _, notes = default_checkpoints(a.target, "init")
    vocab = TargetEngine(target, n_slots=1, max_seq_len=64).vocab_size
    prompts = domain_prompts(target, a.domain, a.prompts, a.offset, vocab)
    longest = max(len(p["ids"]) for p in prompts)
    engine = TargetEngine(target, n_slots=1, max_seq_len=longest + a.max_new_tokens + 18)
    alone = run_prompts(engine, prompts, 0.0, a.max_new_tokens, 0)  # warm-up, and the oracle's text
    references = [p["ids"] + list(o) for p, o in zip(prompts, alone["outputs"])]
    runners: dict = {"target alone": (None, 1, 1, "pick")}
    for name, source, steps, min_conf in methods:
        prop = proposer_for(source, target, engine, steps, min_conf, a.compile, references)
        runners[name] = (prop, steps, 1, "pick")
        run_prompts(engine, prompts[:1], 0.0, a.max_new_tokens, 0, prop, steps)  # warm-up
    runs = run_paired(engine, prompts, 0.0, a.max_new_tokens, 0, runners, a.repeats)
    for m, r in runs.items():
        assert r["outputs"] == runs["target alone"]["outputs"], f"{m}: output differs"

    what = "random-id" if a.domain == "random" else "held-out"
    section = [
        f"## {a.domain}, T = 0 ({datetime.date.today().isoformat()})",
        "",
        *table(runs),
        "",
        f"{len(prompts)} {what} prompts (from number {a.offset + 1}), up to {a.max_new_tokens} new "
        f"tokens each ({runs['target alone']['tokens']} in all), every prompt decoded by every "
        f"method back to back, {a.repeats} rotations, fastest run per prompt kept; target "
        f"`{target}`, {threads} torch threads." + "".join(f" Note: {x}" for x in notes),
        "",
        stamp("bench.drafters", argv),
    ]
    text = "\n".join(section) + "\n"
    print(text)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    if a.append and a.out.is_file():
        a.out.write_text(a.out.read_text() + "\n" + text)
    else:
        about = __doc__.split("\n\n")[2]  # the timing paragraph
        a.out.write_text(f"{TITLE}\n\n{text}\n{about}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
