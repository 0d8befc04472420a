"""Training of the published drafter architectures on this project's drafter data: DFlash
(drafter_service.dflash, z-lab's layout) and EAGLE-3 (drafter_service.eagle3, SafeAILab's).

Same data as every drafter here (`training.drafter_data` shards: the target's own answers and
the hidden states of its feature layers), the same data stream and loop (training.trainer:
AdamW, warmup + cosine, resume, loss.csv / loss.png); the run directory is a checkpoint in the
published layout (bf16 weights), rewritten at every save.

- dflash: a row is an anchor a inside a response; the block [t_a, mask x (block_size - 1)] sits
  at positions a..a+block_size-1 and reads the target features of positions < a (KV injection);
  loss: cross-entropy of the block_size - 1 drafts against t_{a+1}.., slot k weighted
  exp(-(k-1)/slot_loss_decay) as the project's DFlash-style loss (training.flow). The anchors of
  one sequence share its projected context keys / values (one `context_kv` pass per sequence).
- eagle3: training-time test as EAGLE-3 does it. Step 0 runs every position p on the fused
  features of the target's three layers and the token t_{p+1}; step s >= 1 runs position p on
  the layer's own step s-1 output at p-1 in place of fc(features), attending to the real keys
  up to p-s and its own chain (drafter_service.eagle.rollout_mask): slot s+1 of a draft whose
  context ends at p-s. Loss per step: cross-entropy of t_{p+2} (response tokens in the draft
  vocabulary) over the draft vocabulary, step s weighted 0.8^s (EAGLE-3's weights). The draft
  vocabulary is the `draft_vocab_size` most frequent response tokens of the training data
  (eagle3.draft_vocabulary); the draft LM head starts as the target's rows of those tokens.

    python -m training.train_published --arch dflash --target T --data D --out runs/dflash-pub --resume
    python -m training.train_published --arch eagle3 --target T --data D --out runs/eagle3 --resume
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor

from drafter_service.checkpoint import tensor_hash
from drafter_service.dflash import DFlashDrafter, init_dflash, save_dflash
from drafter_service.eagle import rollout_mask
from drafter_service.eagle3 import Eagle3Drafter, init_eagle3, save_eagle3
from flashmap.checkpoint import load_embeddings, read_config
from flashmap.drafter_inputs import eagle3_default_layers
from training.drafter_data import list_shards, read_meta, shard_index
from training.flow import Batch, make_batch, slot_weights, weighted_ce
from training.sequence_stream import SequenceStream
from training.train_eagle import SeqBatch, make_seq_batch
from training.train_options import ConfigDict, add_common_args, config_from_args, run_cli
from training.trainer import run_training

ARCHS = ("dflash", "eagle3")


@dataclass
class PublishedTrainConfig(ConfigDict):
    """Defaults: the budget of checkpoints/demo-dflash-eq (10,500 steps of 8 sequences; DFlash
    draws 8 anchors from each, 64 blocks a step) on the demo target."""

    kind: str = "dflash"  # dflash | eagle3
    steps: int = 10_500
    lr: float = 1e-3
    warmup_steps: int = 200
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    batch_size: int = 8  # sequences per step
    anchors_per_seq: int = 8  # dflash: blocks drawn from each sequence
    max_len: int = 256
    seed: int = 0
    log_every: int = 10
    save_every: int = 250
    amp: bool = True  # bf16 autocast on CUDA
    slot_loss_decay: float = 7.0  # dflash: slot k weighted exp(-(k-1)/decay)
    step_loss_weight: float = 0.8  # eagle3: step s weighted w^s
    # dflash: num_hidden_layers, block_size; eagle3: draft_vocab_size, depth, aux_layer_ids
    arch: dict = field(default_factory=dict)

    @classmethod
    def for_kind(cls, kind: str, small: bool = False) -> PublishedTrainConfig:
        if kind not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {kind!r}")
        arch = (
            dict(num_hidden_layers=5, block_size=16)
            if kind == "dflash"
            else dict(draft_vocab_size=1024, depth=7, aux_layer_ids=None)
        )
        cfg = cls(kind=kind, arch=arch)
        if small:  # tests: tiny targets, a few steps
            cfg = cls(
                kind=kind,
                steps=40,
                lr=3e-3,
                warmup_steps=5,
                batch_size=4,
                anchors_per_seq=4,
                max_len=96,
                log_every=5,
                save_every=20,
                amp=False,
                arch={**arch, "num_hidden_layers": 1} if kind == "dflash" else {**arch, "depth": 3},
            )
        return cfg


class _Config(dict):
    def to_dict(self) -> dict:
        return dict(self)


class Trained(nn.Module):
    """The published network under the training loop: run_training saves and resumes
    `net` through this wrapper; `on_save` then writes the published layout over the run's
    checkpoint files."""

    def __init__(self, net: nn.Module, what: dict):
        super().__init__()
        self.net = net
        self.cfg = _Config(what)


# ----------------------------------------------------------------------------- DFlash


def dflash_logits(model: DFlashDrafter, batch: Batch) -> Tensor:
    """Draft logits [N, block_size - 1, V] of the batch's blocks: every sequence's context
    keys / values once (all layers, one pass), gathered per block."""
    S, T, F_ = batch.features.shape
    pos = torch.arange(T, device=batch.features.device).repeat(S)
    k, v = model.context_kv(batch.features.reshape(S * T, F_), pos)  # [L, S*T, kv, d]
    L = k.shape[0]
    k = k.view(L, S, T, *k.shape[2:])[:, batch.seq_index].transpose(2, 3)  # [L, N, kv, T, d]
    v = v.view(L, S, T, *v.shape[2:])[:, batch.seq_index].transpose(2, 3)
    return model.block_logits(batch.anchor, batch.lengths, list(k), list(v), batch.lengths)


def accepted_prefix(hit: Tensor, mask: Tensor) -> Tensor:
    """Mean length of the leading run of right slots (hit [N, K] bool, within mask)."""
    run = (hit & mask).long().cumprod(1)
    return run.sum(1).float().mean()


def dflash_loss(model: DFlashDrafter, batch: Batch, decay: float) -> tuple[Tensor, dict]:
    logits = dflash_logits(model, batch)
    w = slot_weights(logits.shape[1], decay, logits.device)
    loss = weighted_ce(logits, batch.target, batch.mask, w)
    with torch.no_grad():
        hit = logits.argmax(-1) == batch.target
        stats = {
            "loss": loss.item(),
            "acc1": hit[:, 0][batch.mask[:, 0]].float().mean().item(),
            "prefix": accepted_prefix(hit, batch.mask).item(),
        }
    return loss, stats


# ----------------------------------------------------------------------------- EAGLE-3


def eagle3_rollout(
    model: Eagle3Drafter, batch: SeqBatch, depth: int
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Training-time test on whole sequences (features [B, T, 3H] of the drafter's layers).

    Step 0 runs every position p = 0..T-2 on the real features: o0 [B, T-1, H]. Step s >= 1 at
    p takes the step s-1 output at p-1 in place of fc(features), sees the real keys up to p - s
    and its own chain (the step-r keys at p - s + r); it predicts t_{p+2} as slot s+1 of a draft
    whose context ends at p - s. Steps >= 1 run only on a window of each sequence, positions
    off_b = prompt_len_b - depth onwards (idx [B, W]: no earlier position feeds a response
    token's prediction). Returns (o0, idx, [o_s [B, W, H] for s = 1..depth-1])."""
    B, T = batch.tokens.shape
    P, dev = T - 1, batch.tokens.device
    nxt = batch.tokens[:, 1:]
    g = model.fuse(batch.features[:, :P])
    q, k, v = model.qkv(g, nxt, torch.arange(P, device=dev).expand(B, P))
    keys, vals = [k.transpose(1, 2)], [v.transpose(1, 2)]
    o0 = model.finish(g, q, keys[0], vals[0], rollout_mask(P, 0, dev)[None, None])
    off = (batch.prompt_lens - depth).clamp(min=0)
    W = max(int((batch.lengths - 1 - off).max()), 1)
    j = torch.arange(W, device=dev)
    idx = (off[:, None] + j).clamp(max=P - 1)  # [B, W] real positions (clamped: padding)
    tok = nxt.gather(1, idx)
    prev = o0.gather(1, (idx - 1).clamp(min=0)[..., None].expand(-1, -1, o0.shape[-1]))
    prev = prev * (idx > 0)[..., None]
    outs: list[Tensor] = []
    for s in range(1, depth):
        if s > 1:  # window position j takes j-1's output (j = 0 feeds no response token)
            prev = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], 1)
        q, k, v = model.qkv(prev, tok, idx)
        keys.append(k.transpose(1, 2))
        vals.append(v.transpose(1, 2))
        real = torch.arange(P, device=dev)[None, None] <= (idx - s)[..., None]  # [B, W, P]
        chain = [(j[None] == (j - s + r)[:, None]).expand(B, W, W) for r in range(1, s + 1)]
        mask = torch.cat([real, *chain], -1)[:, None]  # [B, 1, W, P + s W]
        outs.append(model.finish(prev, q, torch.cat(keys, 2), torch.cat(vals, 2), mask))
    return o0, idx, outs


def draft_ids(model: Eagle3Drafter) -> Tensor:
    """[V] the draft id of each target id, -1 outside the draft vocabulary."""
    Vd = model.cfg.draft_vocab_size
    ids = torch.full((model.cfg.vocab_size,), -1, dtype=torch.long, device=model.d2t.device)
    ids[torch.arange(Vd, device=ids.device) + model.d2t] = torch.arange(Vd, device=ids.device)
    return ids


def eagle3_loss(
    model: Eagle3Drafter, batch: SeqBatch, depth: int, step_weight: float
) -> tuple[Tensor, dict]:
    """Step-weighted cross-entropy over the draft vocabulary of every response token t_{p+2}
    that is in it; stats: loss and each step's top-1 accuracy."""
    o0, idx, outs = eagle3_rollout(model, batch, depth)
    B, T = batch.tokens.shape
    p = torch.arange(T - 1, device=batch.tokens.device)[None].expand(B, -1)
    target = torch.cat([batch.tokens[:, 2:], torch.zeros_like(batch.tokens[:, :1])], 1)
    label = draft_ids(model)[target]  # [B, T-1] draft ids, -1 outside the draft vocabulary
    inside = (p + 2 < batch.lengths[:, None]) & (p + 2 >= batch.prompt_lens[:, None])
    inside &= label >= 0
    in_window = (
        torch.arange(idx.shape[1], device=idx.device)[None]
        < (batch.lengths - 1 - (batch.prompt_lens - depth).clamp(min=0))[:, None]
    )
    total, norm, stats = 0.0, 0.0, {}
    for s, o in enumerate([o0, *outs]):
        at = p if s == 0 else idx
        valid = inside.gather(1, at) & (at >= s) & (in_window if s else True)
        if not bool(valid.any()):
            stats[f"acc{s}"] = float("nan")
            continue
        logits = model.lm_head(model.norm(o[valid])).float()  # [n, Vd]
        y = label.gather(1, at)[valid]
        ce = F.cross_entropy(logits, y)
        w = step_weight**s
        total, norm = total + w * ce, norm + w
        stats[f"acc{s}"] = (logits.argmax(-1) == y).float().mean().item()
    if norm == 0:
        raise ValueError("no response token of the draft vocabulary in this batch")
    loss = total / norm
    stats["loss"] = loss.item()
    return loss, stats


def response_token_counts(data: str | Path, vocab_size: int) -> Tensor:
    """[V] how often each token id is a response token in the drafter data (tokens only: the
    features are not read)."""
    counts = np.zeros(vocab_size, np.int64)
    for path in list_shards(data):
        offsets, prompt_lens = shard_index(path)
        with safe_open(str(path), "np") as f:
            tok = f.get_tensor("tokens")
        for a, n, b in zip(offsets[:-1], prompt_lens, offsets[1:]):
            counts += np.bincount(tok[a + n : b], minlength=vocab_size)
    return torch.from_numpy(counts)


def coverage(counts: Tensor, size: int) -> float:
    """Share of the counted tokens the `size` most frequent ids cover."""
    top = counts.sort(descending=True).values[:size].sum()
    return float(top) / max(float(counts.sum()), 1.0)


# ----------------------------------------------------------------------------- training


def _check_data(meta: dict, target: str | Path, layers: list[int]) -> list[int]:
    """The columns (layer indices into the data's features) the drafter reads; refuses data of
    another target or without those layers."""
    t = read_config(target)
    if meta["target_vocab_size"] != int(t["vocab_size"]):
        raise ValueError(f"data vocab {meta['target_vocab_size']} != target's {t['vocab_size']}")
    if meta.get("embed_hash") and meta["embed_hash"] != tensor_hash(load_embeddings(target)[0]):
        raise ValueError("the data were made with another target (embedding hash differs)")
    have = list(meta["feature_layers"])
    missing = [i for i in layers if i not in have]
    if missing:
        raise ValueError(f"the data hold target layers {have}, not the drafter's {missing}")
    return [have.index(i) for i in layers]


def _columns(features: Tensor, cols: list[int], n_layers: int) -> Tensor:
    """The drafter's layers out of data features [.., n_layers * H] -> [.., len(cols) * H]."""
    if cols == list(range(n_layers)):
        return features
    x = features.unflatten(-1, (n_layers, -1))[..., cols, :]
    return x.flatten(-2)


def build_model(tcfg: PublishedTrainConfig, target: str | Path, data: str | Path) -> nn.Module:
    """A fresh network of the run's architecture (the draft vocabulary from the data)."""
    n = int(read_config(target)["num_hidden_layers"])
    if tcfg.kind == "dflash":
        return init_dflash(
            target,
            num_hidden_layers=int(tcfg.arch["num_hidden_layers"]),
            block_size=int(tcfg.arch.get("block_size", 16)),
            target_layer_ids=list(read_meta(data)["feature_layers"]),
            seed=tcfg.seed,
        )
    V = int(read_config(target)["vocab_size"])
    ids = tcfg.arch.get("aux_layer_ids")
    model = init_eagle3(
        target,
        draft_vocab_size=int(tcfg.arch["draft_vocab_size"]),
        token_counts=response_token_counts(data, V),
        aux_layer_ids=tuple(ids) if ids else tuple(eagle3_default_layers(n)),
        seed=tcfg.seed,
    )
    with torch.no_grad():  # the draft LM head starts as the target's rows of the draft vocabulary
        keep = torch.arange(model.cfg.draft_vocab_size) + model.d2t
        model.lm_head.weight.copy_(load_embeddings(target)[1].float()[keep])
    return model


def layers_of(model: nn.Module) -> list[int]:
    if isinstance(model, DFlashDrafter):
        return list(model.cfg.target_layer_ids)
    return list(model.layer_ids)


def train(
    tcfg: PublishedTrainConfig,
    *,
    target: str | Path,
    data: str | Path,
    out: str | Path,
    resume: bool = False,
    device: str = "cpu",
    progress: bool = True,
) -> nn.Module:
    """Train (or continue) one published drafter; returns the network (its checkpoint in out,
    published layout, bf16)."""
    torch.manual_seed(tcfg.seed)
    meta = read_meta(data)
    net = build_model(tcfg, target, data).to(device).train()
    cols = _check_data(meta, target, layers_of(net))
    n_data_layers = len(meta["feature_layers"])
    n_target = int(read_config(target)["num_hidden_layers"])
    stream = SequenceStream(data, seed=tcfg.seed, max_len=tcfg.max_len)
    take = lambda step: stream.take(step * tcfg.batch_size, tcfg.batch_size)  # noqa: E731

    if tcfg.kind == "dflash":
        K = net.block_size

        def batch_fn(step: int) -> Batch:
            rng = np.random.default_rng([tcfg.seed, step, 1])
            b = make_batch(take(step), K, tcfg.anchors_per_seq, tcfg.max_len, rng)
            b.features = _columns(b.features, cols, n_data_layers)
            return b.to(device)

        loss_fn = lambda b: dflash_loss(net, b, tcfg.slot_loss_decay)  # noqa: E731
        names, save = ["loss", "acc1", "prefix"], save_dflash
    else:
        depth = int(tcfg.arch["depth"])

        def batch_fn(step: int) -> SeqBatch:
            b = make_seq_batch(take(step), tcfg.max_len)
            b.features = _columns(b.features, cols, n_data_layers)
            return b.to(device)

        loss_fn = lambda b: eagle3_loss(net, b, depth, tcfg.step_loss_weight)  # noqa: E731
        names, save = ["loss"] + [f"acc{s}" for s in range(depth)], save_eagle3

    wrapped = Trained(net, {"kind": f"{tcfg.kind}-published", "train_config": tcfg.to_dict()})
    run_training(
        wrapped,
        tcfg,
        stage=tcfg.kind,
        stage_name=f"a {tcfg.kind} run",
        out=out,
        resume=resume,
        device=device,
        progress=progress,
        cols=["step", "lr", *names, "elapsed_s"],
        batch_fn=batch_fn,
        loss_fn=loss_fn,
        postfix=lambda stats, lr: {k: f"{stats[k]:.3f}" for k in names[:2]},
        plot_cols=["loss"],
        on_save=lambda step: save(net, out, n_target),
    )
    return net.eval()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m training.train_published", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--arch", choices=ARCHS, required=True)
    add_common_args(
        ap,
        small_help="test-sized preset (tiny drafter, a few steps)",
        batch_help="sequences per step (dflash: --anchors-per-seq blocks from each)",
    )
    ap.add_argument("--anchors-per-seq", type=int)
    ap.add_argument("--num-hidden-layers", type=int, help="dflash: decoder layers")
    ap.add_argument("--draft-vocab-size", type=int, help="eagle3: draft vocabulary")
    ap.add_argument("--depth", type=int, help="eagle3: training-time-test steps")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = config_from_args(
        PublishedTrainConfig.for_kind(args.arch, small=args.small),
        args,
        ("anchors_per_seq",),
        ("num_hidden_layers", "draft_vocab_size", "depth"),
    )
    return run_cli(train, cfg, args, f"{args.arch} checkpoint (published layout) in {args.out}")


if __name__ == "__main__":
    sys.exit(main())
