"""A FlashMap drafter started from a trained DFlash-style one (`--init-from` of the flow stage):
the same backbone, the state projection at zero, so the flow stage starts out drafting what
the baseline drafts and only has to learn what the state adds (the paper trains the flow stage
from scratch)."""

from __future__ import annotations

from dataclasses import MISSING, replace

import torch

from drafter_service.config import DrafterConfig
from drafter_service.dit_blocks import timestep_embedding
from drafter_service.flashmap_dit import FlashMapDiT

ARCH_FIELDS = ("dim", "n_blocks", "n_heads", "block_size", "mlp_ratio", "time_freq_dim", "qk_norm")


def _field_default(cls, name: str):
    f = cls.__dataclass_fields__[name]
    return f.default_factory() if f.default is MISSING else f.default


def warm_start_from_dflash(
    src: FlashMapDiT, constant_time: bool = False, **config_overrides
) -> FlashMapDiT:
    """A flashmap drafter that computes exactly what the DFlash-style `src` computes at the
    1-jump conditioning (s, t) = (0, 1), whatever its input state; with `constant_time` at
    every (s, t), the denoiser at tau = 0 included.

    Both kinds share every module but the slot input: dflash feeds a learned mask vector,
    flashmap a projection of the state. The projection starts at zero and the mask vector
    moves into the slots' position embeddings, so the flow stage starts from the baseline's
    per-slot marginals and only has to learn what the state adds (joint structure). The
    baseline was trained at the one conditioning (0, 1) only; constant_time makes the time
    embedding's first layer start at zero weights with the bias it gave at (0, 1), so every
    time starts from the baseline's conditioning and the dependence on time is learnt.
    config_overrides: non-architecture DrafterConfig fields (pure_noise_fraction, ...)."""
    if src.cfg.kind != "dflash":
        raise ValueError(f"--init-from needs a dflash drafter, got kind {src.cfg.kind!r}")
    bad = sorted(set(config_overrides) & set(ARCH_FIELDS))
    if bad:
        raise ValueError(f"the architecture comes from the --init-from drafter; do not set {bad}")
    # A new flow drafter reads its state and keeps time as new drafters do, whatever the source
    # checkpoint's config says (a dflash config from before these fields carries the legacy values).
    new = {
        f: _field_default(DrafterConfig, f)
        for f in ("time_map", "state_input", "shared_noise", "time_map_candidates")
    }
    cfg = replace(
        src.cfg, kind="flashmap", time_table_t=[], time_table_tau=[], **{**new, **config_overrides}
    )
    model = FlashMapDiT(cfg).to(src.pos_embed.device, src.pos_embed.dtype)
    model.set_target(src.embed, src.lm_head)
    state = {k: v for k, v in src.state_dict().items() if k != "mask_embed"}
    with torch.no_grad():
        state["pos_embed"] = state["pos_embed"].clone()
        state["pos_embed"][1:] += src.mask_embed  # [K, D] slots; row 0 is the anchor
        state["state_in.weight"] = torch.zeros_like(model.state_in.weight)
        if constant_time:
            fd, first = src.cfg.time_freq_dim, src.time_embed[0]
            at_0_1 = torch.cat(  # the embedding src.time_cond feeds its time MLP, [1, 2 fd]
                [timestep_embedding(torch.tensor([v]), fd) for v in (0.0, 1.0)], -1
            ).to(first.weight)
            state["time_embed.0.bias"] = first(at_0_1)[0]
            state["time_embed.0.weight"] = torch.zeros_like(first.weight)
    model.load_state_dict(state)
    return model
