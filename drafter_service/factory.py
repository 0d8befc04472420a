"""The one place that turns a drafter checkpoint (or "init") into a serving proposer.

Every kind goes through here: FlashMap and DFlash-style (FlashMapProposer over a
FlashMapDiT), EAGLE-style (EagleProposer), and the published layouts users already have,
DFlash (DFlashProposer) and EAGLE-3 (Eagle3Proposer, a tree at temperature 0), for the
drafter service, the CLI, the benchmarks and `flashmap eval`.
"""

from __future__ import annotations

from pathlib import Path

from drafter_service import eagle
from drafter_service.checkpoint import checkpoint_kind, init_drafter, load_drafter
from drafter_service.dflash import DFlashDrafter, load_dflash
from drafter_service.dflash_config import is_dflash
from drafter_service.dflash_proposer import DFlashProposer
from drafter_service.eagle3 import Eagle3Drafter, is_eagle3, load_eagle3
from drafter_service.eagle3_proposer import Eagle3Proposer
from drafter_service.flashmap_proposer import FlashMapProposer
from drafter_service.proposer import Proposer
from flashmap.checkpoint import read_config
from flashmap.host_memory import keep_freed_memory
from flashmap.types import DRAFT_STEPS


def load_model(drafter: str | Path, target_dir: str | Path, device: str = "cpu"):
    """The drafter network of a checkpoint directory (any kind), or a fresh FlashMap drafter for
    "init": on a small target a small DiT (width = target hidden, 2 blocks); the paper's
    2048-wide, 6-block default is for full-size targets."""
    if str(drafter) == "init":
        hidden = read_config(target_dir)["hidden_size"]
        small = {} if hidden >= 2048 else {"dim": max(64, hidden), "n_blocks": 2, "n_heads": 4}
        return init_drafter(target_dir, device=device, **small)
    config = read_config(drafter)
    if is_dflash(config):
        return load_dflash(drafter, target_dir, device=device)
    if is_eagle3(config):
        return load_eagle3(drafter, target_dir, device=device)
    if checkpoint_kind(drafter) == "eagle":
        return eagle.load_eagle(drafter, target_dir, device=device)
    return load_drafter(drafter, target_dir, device=device)


def make_proposer(
    model,
    device: str = "cpu",
    n_slots: int = 8,
    max_context: int = 4096,
    steps: int = DRAFT_STEPS,
    min_confidence: float = 0.0,
    compile: bool = False,
    **departures,
) -> Proposer:
    """A proposer around a loaded drafter network (several proposers may share one model).
    min_confidence: FlashMapProposer's draft cut (the EAGLE-style chain has none);
    departures: FlashMapProposer's departures from the paper's inference (shared_noise,
    greedy_estimate, greedy_noise_scale, second_jump_net; default: none); compile: the
    proposer's enable_compile for `steps`."""
    departures = {k: v for k, v in departures.items() if v is not None}  # None: the default
    if str(device).startswith("cpu"):
        keep_freed_memory()  # the cache gathers stay mapped (flashmap.host_memory)
    if isinstance(model, DFlashDrafter):
        proposer = DFlashProposer(model, n_slots=n_slots, max_context=max_context, device=device)
    elif isinstance(model, Eagle3Drafter):
        proposer = Eagle3Proposer(
            model,
            n_slots=n_slots,
            max_context=max_context,
            device=device,
            sampled_tree=departures.get("sampled_tree", True),
        )
    elif isinstance(model, eagle.EagleDrafter):
        proposer = eagle.EagleProposer(
            model, n_slots=n_slots, max_context=max_context, device=device
        )
    else:
        proposer = FlashMapProposer(
            model,
            n_slots=n_slots,
            max_context=max_context,
            device=device,
            steps=steps,
            min_confidence=min_confidence,
            **{k: v for k, v in departures.items() if k != "sampled_tree"},
        )
    if compile:
        proposer.enable_compile(steps=(steps,))
    return proposer


def load_proposer(
    drafter: str | Path,
    target_dir: str | Path,
    device: str = "cpu",
    n_slots: int = 8,
    max_context: int = 4096,
    steps: int = DRAFT_STEPS,
    min_confidence: float = 0.0,
    compile: bool = False,
    **departures,
) -> Proposer:
    """`make_proposer` over `load_model`: a proposer from a checkpoint directory or "init"."""
    return make_proposer(
        load_model(drafter, target_dir, device),
        device=device,
        n_slots=n_slots,
        max_context=max_context,
        steps=steps,
        min_confidence=min_confidence,
        compile=compile,
        **departures,
    )
