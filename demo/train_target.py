"""Train the small demo target (a Qwen3ForCausalLM) from scratch on CPU on the local corpus.

    python -m demo.train_target --out checkpoints/demo-target --threads 2

(the defaults are the settings of the committed demo checkpoint; its README.md says how long
it took and what it reached).

Steps: build the corpus (``demo.corpus``, seeded), write the held-out prompts, train
the byte-level BPE (``demo.tokenizer``), tokenize each domain into one stream
(documents separated by ``<|endoftext|>``; ``demo.target_data``), then train with AdamW,
linear warmup and cosine decay (``demo.target_model``), on random windows of ``--seq-len`` tokens whose domain is
drawn per row (``--mix``). Progress goes to a tqdm bar and to ``<out>/train_log.txt``; the
loss curves to ``<out>/loss_curve.csv`` and ``<out>/loss_curve.png``. A training state
(model, optimizer, sampler RNG, log, elapsed time) is saved every ``--save-every`` steps
under ``--state-dir``; ``--resume`` continues from it and ends with the same weights as an
uninterrupted run (same ``--threads``).

The output is a standard Hugging Face checkpoint directory: config.json, model.safetensors
(fp32, tied embeddings), generation_config.json, tokenizer files with the chat template,
and a model card (README.md) with data, sizes, time, per-domain losses and greedy samples
(``demo.target_checkpoint``, ``demo.target_card``).
"""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning: on a machine shared with other jobs, two
# spinning threads that get descheduled can make every step several times slower. Only
# takes effect when set before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

from demo.corpus import DOMAINS
from demo.target_card import write_curves
from demo.target_checkpoint import final_losses, save_checkpoint, write_summary
from demo.target_data import TargetData, WindowSampler, fixed_windows, prepare_data, save_state
from demo.target_model import eval_loss, lr_at, make_model, make_optimizer, window_loss

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--out", default="checkpoints/demo-target", help="output checkpoint directory")
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--batch-size", type=int, default=6)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads", type=int, default=2, help="torch CPU threads (keep 1-2 on a shared machine)"
    )
    ap.add_argument(
        "--resume", action="store_true", help="continue from the training state in --state-dir"
    )
    ap.add_argument(
        "--state-dir",
        default=None,
        help="where the resumable training state lives (default runs/train_target/<out name>)",
    )
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="leave after this many steps in this invocation (state saved; continue with --resume)",
    )
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument(
        "--eval-windows",
        type=int,
        default=12,
        help="held-out windows per domain at each periodic eval",
    )
    ap.add_argument("--final-eval-windows", type=int, default=32)
    ap.add_argument("--mix", default="code=0.4,math=0.25,chat=0.35", help="domain sampling weights")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=640)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--max-positions", type=int, default=2048)
    ap.add_argument(
        "--corpus-scale", type=float, default=1.0, help="shrink the generated domains (quick tests)"
    )
    ap.add_argument(
        "--tokenizer-chars",
        type=int,
        default=8_000_000,
        help="characters of text the BPE is trained on",
    )
    ap.add_argument(
        "--prompts-out",
        default=None,
        help="folder for the held-out prompts, dev_prompts.jsonl and test_prompts.jsonl "
        "(default demo/data)",
    )
    ap.add_argument(
        "--samples", type=int, default=3, help="greedy samples per domain in the model card"
    )
    ap.add_argument(
        "--no-card", action="store_true", help="skip the final sample generations / model card"
    )
    return ap.parse_args(argv)


class Logger:
    def __init__(self, path: Path, append: bool):
        self.f = path.open("a" if append else "w", encoding="utf-8")

    def __call__(self, msg: str) -> None:
        from tqdm import tqdm

        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        tqdm.write(line, file=sys.stderr)
        self.f.write(line + "\n")
        self.f.flush()


def setup_run(args) -> tuple[Path, Path, bool, Logger]:
    """The output directory, the training state's path, whether to resume, and the log."""
    out = Path(args.out)
    if not out.is_absolute():
        out = REPO / out
    state_dir = (
        Path(args.state_dir) if args.state_dir else REPO / "runs" / "train_target" / out.name
    )
    state_path = state_dir / "train_state.pt"
    resume = args.resume and state_path.is_file()
    out.mkdir(parents=True, exist_ok=True)
    log = Logger(out / "train_log.txt", append=resume)
    if args.resume and not resume:
        log(f"--resume: no state at {state_path}, starting fresh")
    log(f"args: {json.dumps(vars(args))}")
    log(
        f"python {platform.python_version()} torch {torch.__version__} "
        f"threads {torch.get_num_threads()}"
    )
    return out, state_path, resume, log


def snapshot(model, opt, sampler, progress: dict, args, data: TargetData) -> dict:
    """The training state: everything a resumed run needs to end with the same weights."""
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "sampler_rng": sampler.gen.get_state(),
        "torch_rng": torch.get_rng_state(),
        "step": progress["step"],
        "rows": progress["rows"],
        "elapsed": progress["elapsed"],
        "args": vars(args),
        "tokenizer_sha": data.tok_sha,
        "corpus": data.corpus.fingerprint(),
    }


def load_state(state_path: Path, model, opt, sampler, args, data: TargetData, log) -> dict:
    """Restore a training state written by the same run (same tokenizer, corpus and the
    settings that shape the run); returns its progress (step, rows, elapsed)."""
    st = torch.load(state_path, map_location="cpu", weights_only=False)
    if st["tokenizer_sha"] != data.tok_sha or st["corpus"] != data.corpus.fingerprint():
        raise SystemExit(
            f"{state_path}: made with another tokenizer or corpus; remove it or drop --resume"
        )
    for k in ("steps", "seq_len", "batch_size", "lr", "seed", "hidden", "layers", "mix"):
        if st["args"][k] != vars(args)[k]:
            raise SystemExit(
                f"{state_path}: --{k.replace('_', '-')} was {st['args'][k]}, now {vars(args)[k]}"
            )
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["optimizer"])
    sampler.gen.set_state(st["sampler_rng"])
    torch.set_rng_state(st["torch_rng"])
    log(f"resumed at step {st['step']} ({st['elapsed']:.0f}s of training so far)")
    return {"step": st["step"], "rows": st["rows"], "elapsed": st["elapsed"]}


def train_loop(model, opt, sampler, eval_windows: dict, progress: dict, args, save, log) -> None:
    """Steps until --steps (or --stop-after more), updating `progress` in place: one row per
    step (loss, its EMA, per-domain train loss, held-out losses every --eval-every steps);
    save() every --save-every steps."""
    from tqdm import tqdm

    model.train()
    step, rows = progress["step"], progress["rows"]
    bar = tqdm(
        total=args.steps,
        initial=step,
        desc="train",
        mininterval=5,
        dynamic_ncols=True,
        file=sys.stderr,
    )
    ema = rows[-1]["loss_ema"] if rows else None
    stop_at = args.steps if args.stop_after is None else min(args.steps, step + args.stop_after)
    while step < stop_at:
        t_step = time.time()
        lr = lr_at(step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        x, names = sampler.sample(args.batch_size)
        per_row = window_loss(model, x, reduction="none")
        loss = per_row.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip).item()
        opt.step()
        step += 1
        progress["step"] = step
        progress["elapsed"] += time.time() - t_step
        lv = loss.item()
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        row = {
            "step": step,
            "tokens": step * args.batch_size * args.seq_len,
            "lr": lr,
            "loss": lv,
            "loss_ema": ema,
            "grad_norm": gnorm,
            "elapsed_s": round(progress["elapsed"], 2),
        }
        for n in DOMAINS:
            vals = [v for v, nm in zip(per_row.tolist(), names) if nm == n]
            row[f"train_{n}"] = sum(vals) / len(vals) if vals else ""
        if step % args.eval_every == 0 or step == args.steps:
            t_eval = time.time()
            for n in DOMAINS:
                row[f"heldout_{n}"] = eval_loss(model, eval_windows[n])
            progress["elapsed"] += time.time() - t_eval
            elapsed = progress["elapsed"]
            log(
                f"step {step}/{args.steps} loss {lv:.3f} (ema {ema:.3f}) lr {lr:.2e} | held-out "
                + " ".join(f"{n} {row[f'heldout_{n}']:.3f}" for n in DOMAINS)
                + f" | {elapsed:.0f}s, {row['tokens'] / max(elapsed, 1e-9):.0f} tok/s"
            )
        rows.append(row)
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.1e}")
        if step % args.save_every == 0 and step < args.steps:
            save()
    bar.close()


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    out, state_path, resume, log = setup_run(args)
    data = prepare_data(args, out, state_path.parent, resume, log)
    mix = {k: float(v) for k, v in (kv.split("=") for kv in args.mix.split(","))}
    sampler = WindowSampler(data.streams.train, mix, args.seq_len, args.seed + 1)
    eval_windows = {
        n: fixed_windows(data.streams.heldout[n], args.seq_len, args.eval_windows, args.seed + 2)
        for n in DOMAINS
    }

    vocab = data.tok.get_vocab_size()
    model = make_model(vocab, args)
    opt = make_optimizer(model, args)
    progress = {"step": 0, "rows": [], "elapsed": 0.0}
    if resume:
        progress = load_state(state_path, model, opt, sampler, args, data, log)
    log(
        f"model: Qwen3ForCausalLM {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params "
        f"(vocab {vocab}, hidden {args.hidden}, layers {args.layers}, "
        f"heads {args.heads}/{args.kv_heads} x {args.head_dim}, mlp {args.intermediate}); "
        f"{args.steps} steps x {args.batch_size} x {args.seq_len} tokens"
    )

    def save() -> None:
        save_state(state_path, snapshot(model, opt, sampler, progress, args, data))

    train_loop(model, opt, sampler, eval_windows, progress, args, save, log)
    save()
    write_curves(out, progress["rows"])
    step, train_time = progress["step"], progress["elapsed"]
    if step < args.steps:
        log(f"stopped at step {step}/{args.steps} (--stop-after); continue with --resume")
        return {"step": step, "rows": progress["rows"]}

    final = final_losses(model, data.streams, args, log)
    save_checkpoint(model, data.tok, out, args)
    return write_summary(model, data, final, train_time, out, args, argv, log)


if __name__ == "__main__":
    main()
