"""The demo target's model and how it learns: a Qwen3ForCausalLM built from the command line's
sizes (tied embeddings), its AdamW (weight decay on the matrices only) with linear warmup and
cosine decay, and the next-token loss over windows of tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


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


def make_optimizer(model, args) -> torch.optim.AdamW:
    """AdamW, weight decay on the matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def lr_at(step: int, args) -> float:
    """Linear warmup to --lr, then cosine decay to --lr * --min-lr-ratio at --steps."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (
        args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


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
