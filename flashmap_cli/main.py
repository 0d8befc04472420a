"""The `flashmap` command line.

  flashmap generate --in-process --target DIR --drafter DIR|init --prompt TEXT ...
  flashmap generate "prompt" [--url HOST:PORT]        (against a running stack)
  flashmap generate --chat "What can you do?"         (the prompt as a user turn of the chat template)
  flashmap generate --chat "Weather in Paris?" --tools '{"type": "function", ...}' \
      --chat-template-kwargs '{"enable_thinking": false}' --logprobs --top-logprobs 3 --json
  flashmap up                                          (target + drafter + orchestrator)

A conversation's answer goes to stdout, its reasoning (a template that thinks) to stderr, its
tool calls to stdout as `tool call: NAME ARGUMENTS`; --json has them all, with each token's
log-probability when asked.

Bad input is a one-line `error: ...` on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from drafter_service.service_config import DrafterServiceConfig
from flashmap.config import Config, add_arguments, from_args, option, same_as
from flashmap.drafts import TOP_M
from flashmap.request_options import RequestOptions
from flashmap.types import DRAFT_STEPS, InvalidRequest, SpecStats, check_draft_steps
from orchestrator.config import OrchestratorConfig


class UsageError(Exception):
    """A user mistake the CLI reports in one line."""


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _messages(a: GenerateConfig) -> list[dict]:
    """--chat: the prompt as one user turn (after --system's, when given)."""
    system = [{"role": "system", "content": a.system}] if a.system else []
    return system + [{"role": "user", "content": a.prompt}]


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


@dataclass
class GenerateConfig(Config):
    """`flashmap generate`'s options, besides the request's own (RequestOptions' flags)."""

    prompt_text: str | None = option(None, "prompt text (same as --prompt)", flag="prompt_text")
    prompt: str | None = option(None, "prompt text")
    prompt_ids: str | None = option(None, "comma-separated token ids")
    chat: bool = option(
        False,
        "send the prompt as a user message through the target's chat template (what a chat "
        "model expects)",
    )
    system: str | None = option(None, "--chat: a system message before the prompt")
    url: str = option("127.0.0.1:50051", "the orchestrator's address", env="FLASHMAP_URL")
    in_process: bool = option(False, "run target and drafter in this process")
    target: str | None = option(None, "--in-process: target checkpoint dir (HF Qwen3)")
    drafter: str = option(
        "init", "--in-process: drafter checkpoint dir, or 'init' for an untrained drafter"
    )
    ar: bool = option(False, "--in-process: the target alone (autoregressive baseline)")
    min_confidence: float = same_as(
        DrafterServiceConfig,
        "min_confidence",
        env=None,
        help="--in-process: cut greedy drafts before the first slot the drafter is less sure of",
    )
    compile: bool = option(
        False, "--in-process: torch.compile the drafter (the first call compiles)"
    )
    tree_sampling: str = same_as(
        OrchestratorConfig,
        "tree_sampling",
        env=None,
        help="--in-process: how a tree at temperature > 0 is verified (pick, rejection, "
        "siblings; the stack: flashmap up --tree-sampling)",
    )
    sibling_depth: int = same_as(
        OrchestratorConfig,
        "sibling_depth",
        env=None,
        help="--in-process: with --tree-sampling siblings, leaves beside the first N depths only "
        "(0: every depth; the stack: flashmap up --sibling-depth)",
    )
    top_m: int = same_as(
        OrchestratorConfig,
        "top_m",
        env=None,
        help="--in-process: the drafter's support per slot at temperature > 0 (the stack: "
        "flashmap up --top-m)",
    )
    eagle3_chains: bool = same_as(
        DrafterServiceConfig,
        "eagle3_chains",
        env=None,
        help="--in-process: an EAGLE-3 drafter drafts chains at temperature > 0 (the stack: "
        "the drafter service's --eagle3-chains)",
    )
    json: bool = option(False, "print one JSON object instead of text")


@dataclass
class StepsConfig(Config):
    """`flashmap steps`'s options."""

    steps: int | None = option(
        None,
        "the drafter's new step count (1 or 2 jumps, or N); omit to show it",
        flag="steps",
        check=check_draft_steps,
    )
    drafter_url: str = same_as(OrchestratorConfig, "drafter_url", help="the drafter's address")


def _cmd_generate(args) -> int:
    a = from_args(GenerateConfig, args)
    options = from_args(RequestOptions, args)
    if a.prompt is None:
        a.prompt = a.prompt_text
    if a.chat and a.prompt_ids is not None:
        raise UsageError("--chat takes a text prompt, not --prompt-ids")
    if a.system is not None and not a.chat:
        raise UsageError("--system goes with --chat")
    if options.chat_options and not a.chat:
        raise UsageError("--chat-template-kwargs, --tools and --tool-choice go with --chat")
    if not a.in_process:
        if a.min_confidence or a.compile or a.eagle3_chains:
            raise UsageError(
                "--min-confidence, --compile and --eagle3-chains are --in-process options "
                "(for the stack: the drafter service's options of those names)"
            )
        if a.tree_sampling != GenerateConfig.tree_sampling or a.top_m != TOP_M or a.sibling_depth:
            raise UsageError(
                "--tree-sampling, --sibling-depth and --top-m are --in-process options "
                "(for the stack: flashmap up's options of those names)"
            )
        return _generate_remote(a, options)
    if not a.target:
        raise UsageError("--in-process needs --target DIR")
    if a.prompt is None and a.prompt_ids is None:
        raise UsageError("give --prompt TEXT or --prompt-ids 1,2,3")
    if options.stop:
        raise UsageError("--stop needs the stack (stop strings are the orchestrator's)")
    return _generate_in_process(a, options)


def _generate_in_process(a: GenerateConfig, options: RequestOptions) -> int:
    from drafter_service.factory import load_proposer
    from flashmap.drafter_inputs import checkpoint_dir, target_inputs
    from flashmap.inprocess import decode
    from target_service.engine import TargetEngine

    drafter_dir = None if a.ar else checkpoint_dir(a.drafter)
    layers, _ = target_inputs(drafter_dir, a.target, project=False)  # the drafter's layers
    engine = TargetEngine(a.target, n_slots=1, feature_layers=layers)
    tokenizer, chat = None, None
    if a.prompt_ids is not None:
        prompt_ids = _parse_ids(a.prompt_ids)
    else:
        from flashmap.tokenizer import TextTokenizer

        tokenizer = TextTokenizer(a.target)
        text = a.prompt
        if a.chat:
            text, chat = tokenizer.render_conversation(
                _messages(a), options.tools, options.tool_choice, options.chat_template_kwargs
            )
        prompt_ids = tokenizer.encode(text)
    req = options.to_request(  # the edge: trusted from here on
        prompt_ids,
        vocab_size=engine.vocab_size,
        max_seq_len=engine.max_seq_len,
        eos_token_ids=engine.eos_token_ids,
    )
    proposer = (
        None
        if a.ar
        else load_proposer(
            a.drafter,
            a.target,
            n_slots=1,
            max_context=engine.max_seq_len,
            steps=options.draft_steps or DRAFT_STEPS,  # what --compile compiles
            min_confidence=a.min_confidence,
            compile=a.compile,
            sampled_tree=not a.eagle3_chains,
        )
    )
    (res,) = decode(
        engine,
        [req],
        proposer,
        tree_sampling=a.tree_sampling,
        top_m=a.top_m,
        sibling_depth=a.sibling_depth,
    )
    s = res.stats
    out = {
        "token_ids": res.token_ids,
        "finish_reason": res.finish_reason,
        "mode": "autoregressive" if a.ar else "speculative",
        "rounds": s.rounds,
        "drafts": s.drafts,
        "draft_tokens": s.draft_tokens,
        "accepted": s.accepted,
        "mean_acceptance_length": round(s.mean_acceptance_length, 4),
        "accepted_per_slot": s.accepted_per_slot.tolist(),
        "seconds": round(res.wall_s, 4),
        "tokens_per_s": round(len(res.token_ids) / max(res.wall_s, 1e-9), 2),
    }
    if tokenizer is None and (Path(a.target) / "tokenizer.json").is_file():
        from flashmap.tokenizer import TextTokenizer

        tokenizer = TextTokenizer(a.target)
    if tokenizer is not None:
        out["text"] = tokenizer.decode(res.token_ids)
    if chat is not None:  # the answer, its reasoning and tool calls, as the server splits them
        from flashmap.chat import ChatReader

        reader = ChatReader(chat)
        whole, rest = reader.push(out["text"]), reader.finish()
        out["text"] = whole.content + rest.content
        out["reasoning_content"] = whole.reasoning + rest.reasoning
        out["tool_calls"] = [c.__dict__ for c in whole.tool_calls + rest.tool_calls]
        out["thinking"] = chat.thinking
    if res.logprobs is not None:
        out["logprobs"] = [x.__dict__ for x in res.logprobs]
    if a.json:
        print(json.dumps(out))
    else:
        if out.get("reasoning_content"):
            print(out["reasoning_content"], file=sys.stderr)
        print(out.get("text", ",".join(map(str, res.token_ids))))
        for c in out.get("tool_calls", ()):
            print(f"tool call: {c['name']} {c['arguments']}")
        print(
            stats_report(out["mode"], len(res.token_ids), res.finish_reason, s, res.wall_s),
            file=sys.stderr,
        )
    return 0


def _generate_remote(a: GenerateConfig, options: RequestOptions) -> int:
    from flashmap.client import Client

    if a.prompt is None and a.prompt_ids is None:
        raise UsageError("give a prompt")
    with Client(a.url) as client:
        kwargs: dict = {"options": options}
        if a.prompt_ids is not None:
            kwargs["prompt_ids"] = _parse_ids(a.prompt_ids)
        elif a.chat:
            kwargs["messages"] = _messages(a)
        else:
            kwargs["prompt"] = a.prompt
        final, chunks = None, []
        for chunk in client.generate_stream(**kwargs):
            if chunk.finished:
                final = chunk
                continue
            chunks.append(chunk)
            if not a.json:
                sys.stderr.write(chunk.reasoning_content)
                sys.stdout.write(chunk.text)
                for c in chunk.tool_calls:
                    sys.stdout.write(f"\ntool call: {c.name} {c.arguments}\n")
                sys.stdout.flush()
        if a.json:
            out = final.as_dict()
            for name in ("token_ids", "text", "reasoning_content", "tool_calls", "logprobs"):
                parts = [getattr(c, name) for c in chunks]
                out[name] = (
                    "".join(parts) if name in ("text", "reasoning_content") else sum(parts, [])
                )
            out["tool_calls"] = [c.__dict__ for c in out["tool_calls"]]
            out["logprobs"] = [x.__dict__ for x in out["logprobs"]]
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

    a = from_args(StepsConfig, args)
    admin = DrafterAdmin(a.drafter_url)  # the token: the environment's, or `flashmap up`'s
    try:
        steps = admin.set_steps(a.steps) if a.steps is not None else admin.get_steps()
    finally:
        admin.close()
    print(steps)
    return 0


def _cmd_up(args) -> int:
    from flashmap.auth import DRAFTER_TOKEN_LOCAL, write_local_secret
    from flashmap_cli.stack import PortsInUse, Stack, StackConfig, Supervisor, default_checkpoints

    target_dir, drafter, notes = default_checkpoints(args.target_dir, args.drafter)
    for n in notes:
        print(f"note: {n}", flush=True)
    cfg = from_args(StackConfig, args, target_dir=target_dir, drafter=drafter)
    # SIGTERM (docker stop, kill, a supervisor) must stop the three children like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    print(
        f"starting Triton target, drafter and orchestrator (logs in {cfg.log_dir}) ...", flush=True
    )
    try:
        stack = Stack(cfg).start()
    except PortsInUse as e:
        print(f"flashmap up: {e}", file=sys.stderr, flush=True)
        return 1
    # For `flashmap steps` and DrafterAdmin in this user's other shells.
    write_local_secret(DRAFTER_TOKEN_LOCAL, cfg.drafter_token)
    lines = [
        "FlashMap Serve is up",
        f'  Generate (gRPC)      {cfg.url}        try: flashmap generate --chat "What can you do?" --url {cfg.url}',
        f"  OpenAI API (HTTP)    {cfg.http_url}  (/completions, /chat/completions, /models)"
        if cfg.http_port
        else "",
        f"  orchestrator metrics http://{cfg.host}:{cfg.metrics_port}/metrics",
        f"  drafter (gRPC)       {cfg.drafter_url}  metrics http://{cfg.host}:{cfg.drafter_metrics_port}/metrics",
        f"  Triton               grpc {cfg.host}:{cfg.triton_grpc_port}  metrics http://{cfg.host}:{cfg.triton_metrics_port}/metrics",
        f"  target {cfg.target_dir}\n  drafter {cfg.drafter} (steps {cfg.steps})",
        "Ctrl-C stops all three.",
    ]
    print("\n".join(x for x in lines if x), flush=True)
    supervisor = Supervisor(stack, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        while True:
            supervisor.step()
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("stopping ...", flush=True)
    finally:
        stack.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="flashmap",
        description="FlashMap Serve: exact speculative decoding with a flow-map drafter",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser(
        "generate", help="generate from a prompt (against the stack, or --in-process)"
    )
    add_arguments(g, GenerateConfig)
    add_arguments(g, RequestOptions)
    g.set_defaults(func=_cmd_generate)

    st = sub.add_parser("steps", help="show or switch the drafter's step count at run time")
    add_arguments(st, StepsConfig)
    st.set_defaults(func=_cmd_steps)

    sub.add_parser(
        "eval", help="acceptance / speedup tables of the drafters (flashmap eval --help)"
    )

    from flashmap_cli.stack import StackConfig

    u = sub.add_parser("up", help="start target (Triton), drafter and orchestrator locally")
    # The checkpoints, unless given, are the ones default_checkpoints finds.
    add_arguments(u, StackConfig, defaults={"target_dir": None, "drafter": None})
    u.set_defaults(func=_cmd_up)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["eval"]:  # its own parser, options and --help (training/evaluate.py)
        from training.evaluate import main as eval_main

        return eval_main(argv[1:], prog="flashmap eval")
    args = build_parser().parse_args(argv)
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
