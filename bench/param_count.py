"""Trainable parameter counts of the FlashMap and DFlash-style drafters for Qwen3-8B.

Builds both on the meta device (shapes only, no memory, no weights) for the real target
shape (vocab 151,936, hidden 4,096, 36 layers, feature layers 1, 9, 17, 25, 33) with the
default DrafterConfig, and writes a per-component breakdown with the arithmetic behind it.

    python -m bench.param_count [--out PATH]
"""

from __future__ import annotations

import torch

from bench.common import RESULTS, parser, write_report
from drafter_service.config import DrafterConfig
from drafter_service.flashmap_dit import FlashMapDiT
from flashmap.types import feature_layers_for

QWEN3_8B = dict(
    target_name="Qwen3-8B",
    vocab_size=151936,
    target_hidden_size=4096,
    target_num_layers=36,
    feature_layers=feature_layers_for(36),
)

# Component of a parameter name (first match wins); block sub-modules are summed over blocks.
COMPONENTS = [
    ("state input (x_s @ E -> D)", ("state_in.",)),
    ("mask embedding (dflash)", ("mask_embed",)),
    ("anchor input (E[a] -> D)", ("anchor_in.",)),
    ("slot positions", ("pos_embed",)),
    ("time embedding (s, t)", ("time_embed.",)),
    ("context projection (5H -> D)", ("ctx_proj.", "ctx_norm.")),
    ("blocks: self-attention", (".self_attn.",)),
    ("blocks: cross-attention", (".cross_attn.",)),
    ("blocks: MLP", (".mlp.",)),
    ("blocks: adaLN-Zero (9 D^2 each)", (".adaln.",)),
    ("output (norm, D -> H)", ("final_norm.", "out_proj.")),
]


def build(kind: str) -> FlashMapDiT:
    with torch.device("meta"):
        return FlashMapDiT(DrafterConfig(kind=kind, **QWEN3_8B))


def breakdown(model: FlashMapDiT) -> dict[str, int]:
    out = {name: 0 for name, _ in COMPONENTS}
    for pname, p in model.named_parameters():
        key = next(
            (
                name
                for name, pats in COMPONENTS
                if any(s in pname or pname.startswith(s) for s in pats)
            ),
            None,
        )
        if key is None:
            raise KeyError(f"parameter {pname} has no component")
        out[key] += p.numel()
    return out


def _fmt(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 100_000 or n == 0 else f"{n / 1e3:.1f}K"


def report() -> tuple[list[str], str, list[str]]:
    """(the table, what it counts, the arithmetic behind it)."""
    models = {kind: build(kind) for kind in ("flashmap", "dflash")}
    parts = {kind: breakdown(m) for kind, m in models.items()}
    cfg = models["flashmap"].cfg
    D = cfg.dim
    frozen = 2 * cfg.vocab_size * cfg.target_hidden_size
    about = (
        f"Built on the meta device with the default `DrafterConfig`: dim {D}, {cfg.n_blocks} "
        f"blocks, {cfg.n_heads} heads, mlp_ratio {cfg.mlp_ratio}, K = {cfg.block_size}; target "
        f"vocab {cfg.vocab_size}, hidden {cfg.target_hidden_size}, feature layers "
        f"{cfg.feature_layers}."
    )
    lines = [
        "| component | FlashMap | DFlash-style |",
        "|---|---:|---:|",
    ]
    for name, _ in COMPONENTS:
        lines.append(
            f"| {name} | {_fmt(parts['flashmap'][name])} | {_fmt(parts['dflash'][name])} |"
        )
    totals = {k: sum(v.values()) for k, v in parts.items()}
    lines += [
        f"| **trainable total** | **{totals['flashmap'] / 1e6:.1f}M** | **{totals['dflash'] / 1e6:.1f}M** |",
        f"| frozen target embedding + LM head (buffers, not saved) | {frozen / 1e6:.1f}M | {frozen / 1e6:.1f}M |",
    ]
    ctx_proj = parts["flashmap"]["context projection (5H -> D)"]
    dflash_fixed = (
        parts["dflash"]["blocks: adaLN-Zero (9 D^2 each)"]
        + parts["dflash"]["time embedding (s, t)"]
    )
    more = [
        "## Why these numbers",
        "",
        f"- One DiT block at width D = {D} costs about 25 D^2 = {25 * D * D / 1e6:.0f}M: self-attention 4 D^2, "
        f"cross-attention 4 D^2 (its K/V read the context already projected to D), MLP 2 * {cfg.mlp_ratio:g} D^2 "
        f"= {2 * cfg.mlp_ratio:g} D^2, and adaLN-Zero 9 D^2 (shift, scale, gate for each of the three "
        "sub-layers, from a D-wide time conditioning). adaLN is the largest single item: more than the MLP.",
        f"- The context projection maps 5 x 4096 = 20480 feature dims to D: {ctx_proj / 1e6:.0f}M. "
        "State input, anchor input and output readout are H x D each (8.4M); the vocabulary-sized matrices "
        "are the target's own, frozen, and not counted.",
        f"- So ours is ~{totals['flashmap'] / 1e9:.2f}B, above the paper's ~0.5B. the design fixes width, "
        "depth and heads but not the MLP ratio, the form of adaLN or the context projection; we took DiT's "
        "choices (MLP ratio 4, full-rank adaLN-Zero). A smaller MLP ratio, a shared or low-rank adaLN, or a "
        "narrower context projection would each close part of the gap; we have not tuned the defaults to hit "
        "the number.",
        "- Our DFlash-style baseline is the same backbone (the state input is replaced by a learned mask "
        "embedding, the time conditioning is fixed), so it is about as large as FlashMap, not ~1B as in the "
        "paper. Since its conditioning is a constant, its time embedding and adaLN layers "
        f"({dflash_fixed / 1e6:.0f}M) "
        "could be folded into per-block shift/scale/gate vectors with no loss of expressiveness; we keep them "
        "so both kinds share one code path. The paper's ~1B for DFlash presumably reflects its own "
        "architecture (for scale: one Qwen3-8B decoder layer is ~193M, five would be ~1B); we did not check "
        "its exact layout.",
    ]
    return lines, about, more


def main(argv: list[str] | None = None) -> int:
    ap = parser("bench.param_count", __doc__, out=RESULTS / "param_count.md")
    a = ap.parse_args(argv)
    table, about, more = report()
    title = "Drafter parameter counts (Qwen3-8B target)"
    print(write_report(a.out, title, table, about, "bench.param_count", argv, more))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
