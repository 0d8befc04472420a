"""Train the small demo target (a Qwen3ForCausalLM) from scratch on CPU on the local corpus.

    python -m training.train_target --out checkpoints/demo-target --threads 2

(the defaults are the settings of the committed demo checkpoint, see its README.md: 900 steps
x 6 x 384 tokens, about 19 minutes on 2 shared cores). A later sweep at equal tokens (600k)
found 4 x 256-token batches (more, smaller steps) better in every domain than 6 x 384
(held-out code 5.46 vs 5.73, math 0.91 vs 1.08, chat 1.48 vs 1.72 nats/token) and peak LR 4e-3
slightly worse than 2e-3; a retrain with ``--batch-size 4 --seq-len 256 --steps 2000
--warmup 100`` (about 25 minutes) is the candidate next demo target, not yet trained.

Steps: build the corpus (``training.corpus``, seeded), write the held-out prompts, train
the byte-level BPE (``training.tokenizer``), tokenize each domain into one stream
(documents separated by ``<|endoftext|>``), then train with AdamW, linear warmup and cosine
decay, on random windows of ``--seq-len`` tokens whose domain is drawn per row
(``--mix``). Progress goes to a tqdm bar and to ``<out>/train_log.txt``; the loss curves
to ``<out>/loss_curve.csv`` and ``<out>/loss_curve.png``. A training state (model,
optimizer, sampler RNG, log, elapsed time) is saved every ``--save-every`` steps under
``--state-dir``; ``--resume`` continues from it and ends with the same weights as an
uninterrupted run (same ``--threads``).

The output is a standard Hugging Face checkpoint directory: config.json, model.safetensors
(fp32, tied embeddings), generation_config.json, tokenizer files with the chat template,
and a model card (README.md) with data, sizes, time, per-domain losses and greedy samples.
"""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning: on a machine shared with other jobs, two
# spinning threads that get descheduled can make every step several times slower. Only
# takes effect when set before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import csv
import hashlib
import json
import math
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
DOMAIN_ORDER = ("code", "math", "chat")


# --------------------------------------------------------------------------- config


def model_config_dict(vocab_size: int, args) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_positions,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        initializer_range=0.02,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        use_cache=True,
    )


def make_model(vocab_size: int, args):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**model_config_dict(vocab_size, args))
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(cfg)
    model.config.architectures = ["Qwen3ForCausalLM"]
    return model


def lr_at(step: int, args) -> float:
    """Linear warmup to --lr, then cosine decay to --lr * --min-lr-ratio at --steps."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (
        args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


# --------------------------------------------------------------------------- data


def tokenize_stream(tok, docs: list[str], eot_id: int) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot_id)
    return torch.tensor(ids, dtype=torch.int32)


@dataclass
class Streams:
    train: dict[str, torch.Tensor]
    heldout: dict[str, torch.Tensor]


class WindowSampler:
    """Random windows of seq_len+1 tokens; each row's domain is drawn from the mix."""

    def __init__(
        self, streams: dict[str, torch.Tensor], mix: dict[str, float], seq_len: int, seed: int
    ):
        self.names = [n for n in DOMAIN_ORDER if mix.get(n, 0) > 0]
        self.streams = streams
        self.weights = torch.tensor([mix[n] for n in self.names], dtype=torch.float64)
        self.seq_len = seq_len
        self.gen = torch.Generator().manual_seed(seed)

    def sample(self, batch: int) -> tuple[torch.Tensor, list[str]]:
        dom = torch.multinomial(self.weights, batch, replacement=True, generator=self.gen).tolist()
        rows, names = [], []
        for d in dom:
            s = self.streams[self.names[d]]
            start = int(torch.randint(0, len(s) - self.seq_len - 1, (1,), generator=self.gen))
            rows.append(s[start : start + self.seq_len + 1])
            names.append(self.names[d])
        return torch.stack(rows).long(), names


def fixed_windows(stream: torch.Tensor, seq_len: int, n: int, seed: int) -> torch.Tensor:
    """n evaluation windows: evenly spaced when the stream is long enough, else seeded."""
    span = seq_len + 1
    if len(stream) >= n * span:
        step = len(stream) // n
        starts = [i * step for i in range(n)]
    else:
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, max(1, len(stream) - span), (n,), generator=g).tolist()
    return torch.stack([stream[s : s + span] for s in starts]).long()


def window_loss(model, x: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    logits = model(input_ids=x[:, :-1]).logits
    loss = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), x[:, 1:].reshape(-1), reduction="none"
    )
    loss = loss.view(x.size(0), -1).mean(dim=1)
    return loss.mean() if reduction == "mean" else loss


@torch.no_grad()
def eval_loss(model, windows: torch.Tensor, batch: int = 8) -> float:
    was = model.training
    model.eval()
    total = 0.0
    for i in range(0, len(windows), batch):
        total += window_loss(model, windows[i : i + batch], reduction="none").sum().item()
    model.train(was)
    return total / len(windows)


# --------------------------------------------------------------------------- state


def save_state(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


# --------------------------------------------------------------------------- generation


@torch.no_grad()
def greedy(
    model, tok, prompt: str, max_new_tokens: int, stop_ids: list[int]
) -> tuple[str, list[int]]:
    model.eval()
    ids = tok.encode(prompt, add_special_tokens=False).ids
    x = torch.tensor([ids])
    out = model.generate(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stop_ids,
        pad_token_id=0,
    )
    new = out[0, len(ids) :].tolist()
    return tok.decode(new, skip_special_tokens=False), new


def _answer(text: str) -> str | None:
    import re

    m = re.search(r"The answer is (x = )?(-?\d+)", text)
    return m.group(2) if m else None


# --------------------------------------------------------------------------- main


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
        help="held-out prompts file (default training/data/heldout_prompts.jsonl)",
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


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    from tqdm import tqdm

    from training.corpus import DOMAINS, HELDOUT_PROMPTS_PATH, build_corpus, write_heldout_prompts
    from training.tokenizer import (
        ENDOFTEXT,
        IM_END,
        load_tokenizer,
        save_tokenizer,
        train_tokenizer,
    )

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
        f"python {platform.python_version()} torch {torch.__version__} threads {torch.get_num_threads()}"
    )

    # ---- corpus, held-out prompts
    t0 = time.time()
    corpus = build_corpus(args.seed, scale=args.corpus_scale)
    prompts_path = write_heldout_prompts(corpus, args.prompts_out or HELDOUT_PROMPTS_PATH)
    stats = corpus.stats()
    log(
        f"corpus {corpus.fingerprint()} from {corpus.stdlib} in {time.time() - t0:.1f}s: {json.dumps(stats)}"
    )
    log(f"held-out prompts -> {prompts_path}")

    # ---- tokenizer
    t0 = time.time()
    if resume and (out / "tokenizer.json").is_file():
        tok = load_tokenizer(out)
        log("tokenizer: reusing the one in the output directory")
    else:
        texts: list[str] = []
        budget = {"code": 0.5, "math": 0.2, "chat": 0.3}
        for name in DOMAINS:
            n = 0
            for d in corpus.domains[name].train:
                if n >= args.tokenizer_chars * budget[name]:
                    break
                texts.append(d)
                n += len(d)
        tok = train_tokenizer(texts, vocab_size=args.vocab_size)
        save_tokenizer(tok, out, model_max_length=args.max_positions)
    tok_sha = file_sha(out / "tokenizer.json")
    vocab = tok.get_vocab_size()
    eot = tok.token_to_id(ENDOFTEXT)
    im_end = tok.token_to_id(IM_END)
    log(f"tokenizer: vocab {vocab}, sha {tok_sha}, {time.time() - t0:.1f}s")

    # ---- token streams
    t0 = time.time()
    cache = state_dir / f"tokens-{corpus.fingerprint()}-{tok_sha}.pt"
    if cache.is_file():
        streams = Streams(**torch.load(cache, weights_only=True))
    else:
        streams = Streams(
            train={n: tokenize_stream(tok, corpus.domains[n].train, eot) for n in DOMAINS},
            heldout={n: tokenize_stream(tok, corpus.domains[n].heldout, eot) for n in DOMAINS},
        )
        save_state(cache, {"train": streams.train, "heldout": streams.heldout})
    tok_stats = {
        n: {
            "train_tokens": len(streams.train[n]),
            "heldout_tokens": len(streams.heldout[n]),
            "chars_per_token": round(stats[n]["train_chars"] / max(1, len(streams.train[n])), 2),
        }
        for n in DOMAINS
    }
    log(f"tokens: {json.dumps(tok_stats)} ({time.time() - t0:.1f}s)")

    mix = {k: float(v) for k, v in (kv.split("=") for kv in args.mix.split(","))}
    sampler = WindowSampler(streams.train, mix, args.seq_len, args.seed + 1)
    eval_windows = {
        n: fixed_windows(streams.heldout[n], args.seq_len, args.eval_windows, args.seed + 2)
        for n in DOMAINS
    }

    # ---- model, optimizer
    model = make_model(vocab, args)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    step, rows, elapsed = 0, [], 0.0
    if resume:
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        if st["tokenizer_sha"] != tok_sha or st["corpus"] != corpus.fingerprint():
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
        step, rows, elapsed = st["step"], st["rows"], st["elapsed"]
        log(f"resumed at step {step} ({elapsed:.0f}s of training so far)")
    log(
        f"model: Qwen3ForCausalLM {n_params / 1e6:.2f}M params "
        f"(vocab {vocab}, hidden {args.hidden}, layers {args.layers}, heads {args.heads}/{args.kv_heads} x {args.head_dim}, "
        f"mlp {args.intermediate}); {args.steps} steps x {args.batch_size} x {args.seq_len} tokens"
    )

    def snapshot() -> dict:
        return {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "sampler_rng": sampler.gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "step": step,
            "rows": rows,
            "elapsed": elapsed,
            "args": vars(args),
            "tokenizer_sha": tok_sha,
            "corpus": corpus.fingerprint(),
        }

    # ---- train
    model.train()
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
        elapsed += time.time() - t_step
        lv = loss.item()
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        row = {
            "step": step,
            "tokens": step * args.batch_size * args.seq_len,
            "lr": lr,
            "loss": lv,
            "loss_ema": ema,
            "grad_norm": gnorm,
            "elapsed_s": round(elapsed, 2),
        }
        for n in DOMAINS:
            vals = [v for v, nm in zip(per_row.tolist(), names) if nm == n]
            row[f"train_{n}"] = sum(vals) / len(vals) if vals else ""
        if step % args.eval_every == 0 or step == args.steps:
            t_eval = time.time()
            for n in DOMAINS:
                row[f"heldout_{n}"] = eval_loss(model, eval_windows[n])
            elapsed += time.time() - t_eval
            log(
                f"step {step}/{args.steps} loss {lv:.3f} (ema {ema:.3f}) lr {lr:.2e} | held-out "
                + " ".join(f"{n} {row[f'heldout_{n}']:.3f}" for n in DOMAINS)
                + f" | {elapsed:.0f}s, {row['tokens'] / max(elapsed, 1e-9):.0f} tok/s"
            )
        rows.append(row)
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.1e}")
        if step % args.save_every == 0 and step < args.steps:
            save_state(state_path, snapshot())
    bar.close()
    save_state(state_path, snapshot())
    train_time = elapsed
    if step < args.steps:
        write_curves(out, rows)
        log(f"stopped at step {step}/{args.steps} (--stop-after); continue with --resume")
        return {"step": step, "rows": rows}

    # ---- loss curves
    write_curves(out, rows)

    # ---- final evaluation (fixed windows, more of them)
    t0 = time.time()
    final = {}
    for n in DOMAINS:
        tr = fixed_windows(streams.train[n], args.seq_len, args.final_eval_windows, args.seed + 3)
        he = fixed_windows(streams.heldout[n], args.seq_len, args.final_eval_windows, args.seed + 4)
        final[n] = {
            "train_loss": round(eval_loss(model, tr), 4),
            "heldout_loss": round(eval_loss(model, he), 4),
        }
    log(
        f"final losses (nats/token, {args.final_eval_windows} windows of {args.seq_len}): {json.dumps(final)} ({time.time() - t0:.0f}s)"
    )

    # ---- save the HF checkpoint
    from transformers import GenerationConfig

    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=eot,
        eos_token_id=[im_end, eot],
        pad_token_id=eot,
        do_sample=False,
        max_new_tokens=256,
    )
    model.save_pretrained(out, safe_serialization=True)
    # Also state rope_theta at the top level, as transformers 4.x and other readers expect.
    cfg_path = out / "config.json"
    cfg_json = json.loads(cfg_path.read_text())
    cfg_json.setdefault(
        "rope_theta", cfg_json.get("rope_parameters", {}).get("rope_theta", 10000.0)
    )
    cfg_path.write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
    save_tokenizer(
        tok, out, model_max_length=args.max_positions
    )  # after save_pretrained, so ours win

    # ---- greedy samples and the model card
    summary = {
        "params": n_params,
        "config": model_config_dict(vocab, args),
        "steps": args.steps,
        "tokens_seen": args.steps * args.batch_size * args.seq_len,
        "train_time_s": round(train_time, 1),
        "threads": args.threads,
        "seed": args.seed,
        "final": final,
        "corpus": {
            "fingerprint": corpus.fingerprint(),
            "stdlib": corpus.stdlib,
            "python": platform.python_version(),
            "stats": stats,
            "tokens": tok_stats,
        },
        "tokenizer_sha": tok_sha,
        "argv": sys.argv[1:] if argv is None else list(argv),
        "args": vars(args),
    }
    if not args.no_card:
        t0 = time.time()
        samples, math_eval = make_samples(model, tok, corpus, args, stop_ids=[im_end, eot])
        summary["math_heldout_exact"] = math_eval
        log(
            f"greedy samples in {time.time() - t0:.0f}s; held-out math exact-answer accuracy {math_eval}"
        )
        for s in samples:
            log(f"--- sample {s['id']}\n{s['prompt']}<<<GEN>>>{s['output']}")
        with (out / "samples.jsonl").open("w", encoding="utf-8") as f:
            for s in samples:
                f.write(json.dumps(s, ensure_ascii=False) + "\n")
        write_card(out, summary, samples, args)
    summary["checkpoint_bytes"] = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(
        f"saved {out} ({summary['checkpoint_bytes'] / 1e6:.1f} MB); training time {train_time:.0f}s"
    )
    return summary


def make_samples(model, tok, corpus, args, stop_ids):
    budget = {"code": 96, "math": 64, "chat": 96}
    samples = []
    for n in DOMAIN_ORDER:
        for p in corpus.domains[n].prompts[: args.samples]:
            text, _ = greedy(model, tok, p["prompt"], budget[n], stop_ids)
            samples.append(
                {
                    "domain": n,
                    "id": p["id"],
                    "prompt": p["prompt"],
                    "output": text,
                    "reference": p["reference"],
                }
            )
    # Exact-answer accuracy on all held-out math prompts (the number after "The answer is").
    right = 0
    mp = corpus.domains["math"].prompts
    for p in mp:
        text, _ = greedy(model, tok, p["prompt"], 64, stop_ids)
        right += int(_answer(text) is not None and _answer(text) == _answer(p["reference"]))
    return samples, f"{right}/{len(mp)}"


def write_curves(out: Path, rows: list[dict]) -> None:
    if not rows:
        return
    fields = list(rows[0].keys())
    for r in rows:
        for k in r:
            if k not in fields:
                fields.append(k)
    with (out / "loss_curve.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.5g}" if isinstance(v, float) else v) for k, v in r.items()})
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["loss"] for r in rows], color="0.8", lw=0.8, label="train (batch)")
    ax.plot(steps, [r["loss_ema"] for r in rows], color="k", lw=1.5, label="train (EMA)")
    colors = {"code": "tab:blue", "math": "tab:orange", "chat": "tab:green"}
    for n in DOMAIN_ORDER:
        pts = [(r["step"], r[f"heldout_{n}"]) for r in rows if r.get(f"heldout_{n}", "") != ""]
        if pts:
            ax.plot(*zip(*pts), marker="o", ms=3, color=colors[n], label=f"held-out {n}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    ax.set_title("demo target: training loss")
    fig.tight_layout()
    fig.savefig(out / "loss_curve.png", dpi=110)
    plt.close(fig)


def _fence(text: str) -> str:
    return "````text\n" + text.replace("````", "` ` ` `") + "\n````"


def write_card(out: Path, s: dict, samples: list[dict], args) -> None:
    c = s["config"]
    st = s["corpus"]["stats"]
    tk = s["corpus"]["tokens"]
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [qwen3, tiny, demo, flashmap-serve]",
        "---",
        "",
        "# demo-target: a tiny Qwen3 trained from scratch on CPU",
        "",
        "The default target model of FlashMap Serve: a standard Hugging Face Qwen3 checkpoint "
        "(`Qwen3ForCausalLM`) small enough to commit and to serve on CPU, trained here from local text only. "
        "It is a *demo*: it produces plausible text in its three domains (Python code, arithmetic with worked "
        "solutions, short ChatML dialogues); it is not a useful assistant.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'tok = AutoTokenizer.from_pretrained("{out.relative_to(REPO) if out.is_relative_to(REPO) else out}")',
        f'model = AutoModelForCausalLM.from_pretrained("{out.relative_to(REPO) if out.is_relative_to(REPO) else out}")',
        'ids = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True, return_tensors="pt")',
        "```",
        "",
        "## Model",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | Qwen3ForCausalLM, {s['params'] / 1e6:.2f}M parameters, fp32 safetensors |",
        f"| layers / hidden / MLP | {c['num_hidden_layers']} / {c['hidden_size']} / {c['intermediate_size']} |",
        f"| attention | {c['num_attention_heads']} query heads, {c['num_key_value_heads']} KV heads (GQA), head dim {c['head_dim']}, RoPE theta {c['rope_parameters']['rope_theta']:g} |",
        f"| vocabulary | {c['vocab_size']} (byte-level BPE, Qwen2 pre-tokenizer split, digits one per token) |",
        "| embeddings | tied input embedding / LM head |",
        f"| context | trained on {args.seq_len}-token windows; `max_position_embeddings` {c['max_position_embeddings']} (quality drops past {args.seq_len}) |",
        "| special tokens | `<\\|endoftext\\|>` = 0 (document separator, pad, bos), `<\\|im_start\\|>` = 1, `<\\|im_end\\|>` = 2 (eos) |",
        '| chat template | ChatML (Qwen2.5 style), default system prompt "You are a helpful assistant." |',
        "",
        "## Data (all local, nothing downloaded)",
        "",
        f"Built by `training/corpus.py` (seed {s['seed']}, corpus fingerprint `{s['corpus']['fingerprint']}`).",
        "",
        f"- **code**: the Python {s['corpus']['python']} standard library sources (`{s['corpus']['stdlib']}`), "
        "without tests, site-packages, codec tables and generated data; whole files, "
        f"{st['code']['train_docs']} train / {st['code']['heldout_docs']} held-out files.",
        f"- **math**: {st['math']['train_docs']} generated problems with worked solutions "
        "(`Question: ...\\nAnswer: ... The answer is N.`): arithmetic, order of operations, linear equations, "
        "remainders, percentages and word problems; held-out questions never occur in training.",
        f"- **chat**: {st['chat']['train_docs']} ChatML dialogues: Q/A built from docstrings, signatures and short "
        "sources of stdlib functions / classes (held-out dialogues come from the held-out files), arithmetic "
        "(with follow-up turns), word problems, small coding tasks (one phrasing per task held out), small talk.",
        "",
        "| domain | train tokens | held-out tokens | chars / token | sampling weight |",
        "|---|---|---|---|---|",
    ]
    mix = dict(kv.split("=") for kv in args.mix.split(","))
    for n in DOMAIN_ORDER:
        lines.append(
            f"| {n} | {tk[n]['train_tokens']:,} | {tk[n]['heldout_tokens']:,} | {tk[n]['chars_per_token']} | {mix.get(n, 0)} |"
        )
    hours = s["train_time_s"]
    lines += [
        "",
        "## Training",
        "",
        f"`python -m training.train_target {' '.join(s['argv'])}`".rstrip(),
        "",
        f"- {s['steps']} steps x {args.batch_size} windows x {args.seq_len} tokens = {s['tokens_seen']:,} tokens "
        f"(about {s['tokens_seen'] / sum(tk[n]['train_tokens'] for n in DOMAIN_ORDER):.2f} passes over the training streams).",
        f"- AdamW (betas 0.9/0.95, weight decay {args.weight_decay}), peak LR {args.lr:g}, {args.warmup} warmup steps, "
        f"cosine to {args.min_lr_ratio:g} x peak, grad clip {args.grad_clip:g}, seed {s['seed']}.",
        f"- CPU, {s['threads']} thread(s), torch {torch.__version__}: **{hours / 60:.1f} minutes** of training "
        "(excluding corpus / tokenizer build and final evaluation) on a machine shared with other jobs.",
        "- Loss curves: `loss_curve.csv`, `loss_curve.png`; full log: `train_log.txt`; numbers: `training_summary.json`.",
        "",
        "## Results",
        "",
        f"Cross-entropy in nats/token on {args.final_eval_windows} fixed windows of {args.seq_len} tokens per domain:",
        "",
        "| domain | train loss | held-out loss |",
        "|---|---|---|",
    ]
    for n in DOMAIN_ORDER:
        f = s["final"][n]
        lines.append(f"| {n} | {f['train_loss']:.3f} | {f['heldout_loss']:.3f} |")
    if "math_heldout_exact" in s:
        lines += [
            "",
            f"Greedy exact-answer accuracy on the held-out math prompts: **{s['math_heldout_exact']}**.",
        ]
    lines += [
        "",
        "## Greedy samples (held-out prompts, `training/data/heldout_prompts.jsonl`)",
        "",
        "The prompt is followed by `<<<GEN>>>` and the model's greedy continuation.",
        "",
    ]
    for smp in samples:
        lines += [f"### {smp['id']}", "", _fence(smp["prompt"] + "<<<GEN>>>" + smp["output"]), ""]
    lines += [
        "## Limitations",
        "",
        "- Tiny and briefly trained: code is plausible-looking but usually wrong; answers are memorised patterns; "
        "docstring answers often name the wrong thing.",
        "- Only English, Python and small integer arithmetic. Not for any real use.",
        "- The code data is the CPython standard library (PSF license).",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
