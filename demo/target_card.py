"""What a trained demo target ships with beside its weights: greedy samples on held-out
prompts, the loss curves (CSV and PNG) and the model card (README.md)."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import torch

from demo.corpus import DOMAINS

REPO = Path(__file__).resolve().parent.parent


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
    m = re.search(r"The answer is (x = )?(-?\d+)", text)
    return m.group(2) if m else None


def make_samples(model, tok, corpus, args, stop_ids):
    budget = {"code": 96, "math": 64, "chat": 96}
    samples = []
    for n in DOMAINS:
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
    for n in DOMAINS:
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
        'ids = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], '
        'add_generation_prompt=True, return_tensors="pt")',
        "```",
        "",
        "## Model",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | Qwen3ForCausalLM, {s['params'] / 1e6:.2f}M parameters, fp32 safetensors |",
        f"| layers / hidden / MLP | {c['num_hidden_layers']} / {c['hidden_size']} / {c['intermediate_size']} |",
        f"| attention | {c['num_attention_heads']} query heads, {c['num_key_value_heads']} KV heads "
        f"(GQA), head dim {c['head_dim']}, RoPE theta {c['rope_parameters']['rope_theta']:g} |",
        f"| vocabulary | {c['vocab_size']} (byte-level BPE, Qwen2 pre-tokenizer split, digits one per token) |",
        "| embeddings | tied input embedding / LM head |",
        f"| context | trained on {args.seq_len}-token windows; `max_position_embeddings` "
        f"{c['max_position_embeddings']} (quality drops past {args.seq_len}) |",
        "| special tokens | `<\\|endoftext\\|>` = 0 (document separator, pad, bos), "
        "`<\\|im_start\\|>` = 1, `<\\|im_end\\|>` = 2 (eos) |",
        '| chat template | ChatML (Qwen2.5 style), default system prompt "You are a helpful assistant." |',
        "",
        "## Data (all local, nothing downloaded)",
        "",
        f"Built by `demo/corpus.py` (seed {s['seed']}, corpus fingerprint `{s['corpus']['fingerprint']}`).",
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
    for n in DOMAINS:
        lines.append(
            f"| {n} | {tk[n]['train_tokens']:,} | {tk[n]['heldout_tokens']:,} | "
            f"{tk[n]['chars_per_token']} | {mix.get(n, 0)} |"
        )
    hours = s["train_time_s"]
    lines += [
        "",
        "## Training",
        "",
        f"`python -m demo.train_target {' '.join(s['argv'])}`".rstrip(),
        "",
        f"- {s['steps']} steps x {args.batch_size} windows x {args.seq_len} tokens = {s['tokens_seen']:,} tokens "
        f"(about {s['tokens_seen'] / sum(tk[n]['train_tokens'] for n in DOMAINS):.2f} passes over "
        "the training streams).",
        f"- AdamW (betas 0.9/0.95, weight decay {args.weight_decay}), peak LR {args.lr:g}, {args.warmup} warmup steps, "
        f"cosine to {args.min_lr_ratio:g} x peak, grad clip {args.grad_clip:g}, seed {s['seed']}.",
        f"- CPU, {s['threads']} thread(s), torch {torch.__version__}: **{hours / 60:.1f} minutes** of training "
        "(excluding corpus / tokenizer build and final evaluation) on a machine shared with other jobs.",
        "- Loss curves: `loss_curve.csv`, `loss_curve.png`; full log: `train_log.txt`; "
        "numbers: `training_summary.json`.",
        "",
        "## Results",
        "",
        f"Cross-entropy in nats/token on {args.final_eval_windows} fixed windows of {args.seq_len} tokens per domain:",
        "",
        "| domain | train loss | held-out loss |",
        "|---|---|---|",
    ]
    for n in DOMAINS:
        f = s["final"][n]
        lines.append(f"| {n} | {f['train_loss']:.3f} | {f['heldout_loss']:.3f} |")
    if "math_heldout_exact" in s:
        lines += [
            "",
            f"Greedy exact-answer accuracy on the held-out math prompts: **{s['math_heldout_exact']}**.",
        ]
    lines += [
        "",
        "## Greedy samples (held-out prompts, `demo/data/dev_prompts.jsonl`)",
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
