"""What a finished demo-target run writes: the per-domain final losses, the Hugging Face
checkpoint (weights, config, generation config, tokenizer), training_summary.json, and unless
--no-card the greedy samples and the model card (demo.target_card).
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

from demo.corpus import DOMAINS
from demo.target_card import make_samples, write_card
from demo.target_data import TargetData, fixed_windows
from demo.target_model import eval_loss, model_config_dict
from demo.tokenizer import ENDOFTEXT, IM_END, save_tokenizer


def final_losses(model, streams, args, log) -> dict:
    """Per domain, train and held-out loss on --final-eval-windows fixed windows."""
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
        f"final losses (nats/token, {args.final_eval_windows} windows of {args.seq_len}): "
        f"{json.dumps(final)} ({time.time() - t0:.0f}s)"
    )
    return final


def save_checkpoint(model, tok, out: Path, args) -> None:
    """The Hugging Face checkpoint: weights, config, generation config, tokenizer."""
    from transformers import GenerationConfig

    eot, im_end = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)
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
    save_tokenizer(tok, out, model_max_length=args.max_positions)  # after save_pretrained: ours win


def write_summary(
    model, data: TargetData, final: dict, train_time: float, out: Path, args, argv, log
) -> dict:
    """training_summary.json, and unless --no-card the greedy samples and the model card."""
    tok, corpus = data.tok, data.corpus
    summary = {
        "params": sum(p.numel() for p in model.parameters()),
        "config": model_config_dict(tok.get_vocab_size(), args),
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
            "stats": data.stats,
            "tokens": data.tok_stats,
        },
        "tokenizer_sha": data.tok_sha,
        "argv": sys.argv[1:] if argv is None else list(argv),
        "args": vars(args),
    }
    if not args.no_card:
        t0 = time.time()
        stop_ids = [tok.token_to_id(IM_END), tok.token_to_id(ENDOFTEXT)]
        samples, math_eval = make_samples(model, tok, corpus, args, stop_ids=stop_ids)
        summary["math_heldout_exact"] = math_eval
        log(
            f"greedy samples in {time.time() - t0:.0f}s; "
            f"held-out math exact-answer accuracy {math_eval}"
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
