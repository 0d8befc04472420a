"""The `flashmap` command line.

  flashmap generate --in-process --target DIR --drafter DIR|init --prompt TEXT ...
  flashmap generate "prompt" [--url HOST:PORT]        (against a running stack)
  flashmap generate --chat "What can you do?"         (the prompt as a user turn of the chat template)
  flashmap up                                          (target + drafter + orchestrator)

Bad input is a one-line `error: ...` on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from flashmap.types import InvalidRequest, SamplingParams, SpecStats

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_TARGET = REPO_ROOT / "checkpoints" / "demo-target"
DEMO_DRAFTER = REPO_ROOT / "checkpoints" / "demo-flashmap"


class UsageError(Exception):
    """A user mistake the CLI reports in one line."""


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _messages(args) -> list[dict]:
    """--chat: the prompt as one user turn (after --system's, when given)."""
    system = [{"role": "system", "content": args.system}] if args.system else []
    return system + [{"role": "user", "content": args.prompt}]


def stats_report(
    mode: str, n_tokens: int, finish: str, s: SpecStats, seconds: float, ttft_s: float | None = None
) -> str:
    """What `flashmap generate` prints on stderr after the text: speed, then how speculation went."""
    rate = n_tokens / max(seconds, 1e-9)
    head = f"[{mode}] {n_tokens} tokens in {seconds:.2f} s ({rate:.1f} tokens/s), finish: {finish}"
    if ttft_s:
        head += f", first token after {ttft_s * 1e3:.0f} ms"
    lines = [head]
    if s.drafts:
        steps = (
            f", {s.draft_steps} flow-map step{'s' if s.draft_steps != 1 else ''}"
            if s.draft_steps
            else ""
        )
        lines.append(
            f"  mean acceptance length {s.mean_acceptance_length:.2f} tokens per drafted round: "
            f"{s.accepted} of {s.draft_tokens} draft tokens accepted in {s.drafts} drafted "
            f"round{'s' if s.drafts != 1 else ''} "
            f"({s.rounds} rounds in all{steps})"
        )
        reached = [k for k in range(len(s.verified_per_slot)) if s.verified_per_slot[k]]
        per_slot = "  ".join(
            f"{k + 1}: {s.accepted_per_slot[k]}/{s.verified_per_slot[k]}" for k in reached
        )
        lines.append(f"  accepted / reached, by draft slot: {per_slot}")
    else:
        lines.append(f"  no drafts: {s.rounds} rounds decoded by the target alone")
    if s.fallback_rounds:
        lines.append(
            f"  fallback rounds (drafter down or late, the target decoded alone): {s.fallback_rounds}"
        )
    return "\n".join(lines)


def _sampling(args) -> SamplingParams:
    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed).validate()


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--draft-steps",
        type=int,
        default=None,
        help="flow-map jumps (1, 2) or N Euler steps of the teacher",
    )
    p.add_argument(
        "--stop-id", type=int, action="append", default=[], help="extra stop token id (repeatable)"
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="do not stop at the target's end-of-sequence ids"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _cmd_generate(args) -> int:
    if args.chat and args.prompt_ids is not None:
        raise UsageError("--chat takes a text prompt, not --prompt-ids")
    if args.system is not None and not args.chat:
        raise UsageError("--system goes with --chat")
    if not args.in_process:
        if args.tree_blocks != 1 or args.min_confidence or args.compile:
            raise UsageError(
                "--tree-blocks, --min-confidence and --compile are --in-process options "
                "(for the stack: the drafter service's --min-confidence and --compile)"
            )
        return _generate_remote(args)
    if not args.target:
        raise UsageError("--in-process needs --target DIR")
    if args.prompt is None and args.prompt_ids is None:
        raise UsageError("give --prompt TEXT or --prompt-ids 1,2,3")
    from drafter_service.factory import load_proposer
    from flashmap.inprocess import decode
    from flashmap.types import GenerationRequest
    from target_service.engine import TargetEngine

    params = _sampling(args)
    engine = TargetEngine(args.target, n_slots=1)
    tokenizer = None
    if args.prompt_ids is not None:
        prompt_ids = _parse_ids(args.prompt_ids)
    else:
        from flashmap.tokenizer import TextTokenizer

        tokenizer = TextTokenizer(args.target)
        prompt_ids = tokenizer.encode(
            tokenizer.render_chat(_messages(args)) if args.chat else args.prompt
        )
    stop = () if args.ignore_eos else tuple(engine.eos_token_ids)
    req = GenerationRequest(
        prompt_ids, args.max_new_tokens, params, stop + tuple(args.stop_id), args.draft_steps
    )
    req.validate(engine.vocab_size, engine.max_seq_len)
    proposer = (
        None
        if args.ar
        else load_proposer(
            args.drafter,
            args.target,
            n_slots=1,
            max_context=engine.max_seq_len,
            steps=args.draft_steps or 1,
            min_confidence=args.min_confidence,
            compile=args.compile,
        )
    )
    if args.tree_blocks < 1:
        raise UsageError(f"--tree-blocks must be >= 1, got {args.tree_blocks}")
    (res,) = decode(
        engine,
        [req],
        proposer,
        steps=args.draft_steps or 1,
        tree_blocks=1 if args.ar else args.tree_blocks,
    )
    s = res.stats
    out = {
        "token_ids": res.token_ids,
        "finish_reason": res.finish_reason,
        "mode": "autoregressive" if args.ar else "speculative",
        "rounds": s.rounds,
        "drafts": s.drafts,
        "accepted": s.accepted,
        "mean_acceptance_length": round(s.mean_acceptance_length, 4),
        "accepted_per_slot": s.accepted_per_slot.tolist(),
        "seconds": round(res.wall_s, 4),
        "tokens_per_s": round(len(res.token_ids) / max(res.wall_s, 1e-9), 2),
    }
    if tokenizer is None and (Path(args.target) / "tokenizer.json").is_file():
        from flashmap.tokenizer import TextTokenizer

        tokenizer = TextTokenizer(args.target)
    if tokenizer is not None:
        out["text"] = tokenizer.decode(res.token_ids)
    if args.json:
        print(json.dumps(out))
    else:
        print(out.get("text", ",".join(map(str, res.token_ids))))
        print(
            stats_report(out["mode"], len(res.token_ids), res.finish_reason, s, res.wall_s),
            file=sys.stderr,
        )
    return 0


def _generate_remote(args) -> int:
    from flashmap.client import Client

    if args.prompt is None and args.prompt_ids is None:
        raise UsageError("give a prompt")
    with Client(args.url) as client:
        kwargs = dict(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            draft_steps=args.draft_steps,
            stop_token_ids=args.stop_id,
            ignore_eos=args.ignore_eos,
        )
        if args.prompt_ids is not None:
            kwargs["prompt_ids"] = _parse_ids(args.prompt_ids)
        elif args.chat:
            kwargs["messages"] = _messages(args)
        else:
            kwargs["prompt"] = args.prompt
        final, ids, text = None, [], []
        for chunk in client.generate_stream(**kwargs):
            if chunk.finished:
                final = chunk
                continue
            ids.extend(chunk.token_ids)
            text.append(chunk.text)
            if not args.json:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        if args.json:
            out = {**final.as_dict(), "token_ids": ids, "text": "".join(text)}
            del out["finished"]
            print(json.dumps(out))
        else:
            print()
            print(
                stats_report(
                    "stack",
                    final.completion_tokens,
                    final.finish_reason,
                    final.stats,
                    final.total_s,
                    final.time_to_first_token_s,
                ),
                file=sys.stderr,
            )
    return 0


def _cmd_steps(args) -> int:
    from flashmap.client import DrafterAdmin

    admin = DrafterAdmin(args.drafter_url)  # the token: the environment's, or `flashmap up`'s
    try:
        steps = admin.set_steps(args.steps) if args.steps is not None else admin.get_steps()
    finally:
        admin.close()
    print(steps)
    return 0


def _cmd_up(args) -> int:
    from flashmap_cli.stack import run_stack

    return run_stack(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="flashmap",
        description="FlashMap Serve: exact speculative decoding with a flow-map drafter",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser(
        "generate", help="generate from a prompt (against the stack, or --in-process)"
    )
    g.add_argument("prompt_text", nargs="?", default=None, help="prompt text (same as --prompt)")
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompt-ids", default=None, help="comma-separated token ids")
    g.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message through the target's chat template (what a chat model expects)",
    )
    g.add_argument("--system", default=None, help="--chat: a system message before the prompt")
    g.add_argument(
        "--in-process", action="store_true", help="run target and drafter in this process"
    )
    g.add_argument("--target", default=None, help="target checkpoint dir (HF Qwen3)")
    g.add_argument(
        "--drafter",
        default="init",
        help="drafter checkpoint dir, or 'init' for an untrained drafter",
    )
    g.add_argument(
        "--ar", action="store_true", help="decode with the target alone (autoregressive baseline)"
    )
    g.add_argument(
        "--min-confidence",
        type=float,
        default=0.0,
        help="--in-process: cut greedy drafts before the first slot the drafter is less sure of",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="--in-process: torch.compile the drafter (CPU; the first call compiles, ~1 min)",
    )
    g.add_argument(
        "--tree-blocks",
        type=int,
        default=1,
        help="--in-process, temperature 0: verify this many drafted blocks as a tree per round",
    )
    g.add_argument(
        "--url",
        default=os.environ.get("FLASHMAP_URL", "127.0.0.1:50051"),
        help="orchestrator address",
    )
    _add_sampling_args(g)
    g.set_defaults(func=_cmd_generate)

    st = sub.add_parser("steps", help="show or switch the drafter's step count at run time")
    st.add_argument(
        "steps",
        nargs="?",
        type=int,
        default=None,
        help="new step count (1 or 2 jumps, or N); omit to show",
    )
    st.add_argument(
        "--drafter-url", default=os.environ.get("FLASHMAP_DRAFTER_URL", "127.0.0.1:50052")
    )
    st.set_defaults(func=_cmd_steps)

    sub.add_parser(
        "eval", help="acceptance / speedup tables of the drafters (flashmap eval --help)"
    )

    u = sub.add_parser("up", help="start target (Triton), drafter and orchestrator locally")
    from flashmap_cli.stack import add_stack_args

    add_stack_args(u)
    u.set_defaults(func=_cmd_up)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["eval"]:  # its own parser, options and --help (training/evaluate.py)
        from training.evaluate import main as eval_main

        return eval_main(argv[1:], prog="flashmap eval")
    args = build_parser().parse_args(argv)
    if getattr(args, "prompt_text", None) is not None and args.prompt is None:
        args.prompt = args.prompt_text
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI's contract: one line, no traceback
        from flashmap.checkpoint import CheckpointError

        known = (UsageError, InvalidRequest, CheckpointError, FileNotFoundError, ValueError)
        from flashmap.client import FlashMapError

        if isinstance(e, known + (FlashMapError,)) or type(e).__name__ == "NoFreeSlot":
            print(f"error: {e}", file=sys.stderr)
            return 2
        if os.environ.get("FLASHMAP_DEBUG"):
            raise
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
