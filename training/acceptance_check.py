"""The held-out acceptance check a training run makes every N steps: the drafter as it stands
drafts a block at held-out anchors and the target verifies it (training.offline_acceptance,
greedy, one verify per block), so a run reports the number serving depends on while it trains.

Held-out data are token data (`training.generate_data` on held-out prompts; features computed
once by the run's target) or drafter data with stored features. Each check appends a row to
OUT/acceptance.csv: step, then gamma (mean accepted length per drafted block, the bonus token
counted) per draft step count.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from flashmap.prompts import for_choosing
from training.drafter_data import TOKEN_FORMAT, Shard, list_shards, read_meta
from training.heldout import HeldoutSequence
from training.offline_acceptance import offline_acceptance
from training.online_features import copy_sharing_frozen

CSV = "acceptance.csv"


def heldout_from(data_dir: str | Path, online, limit: int, block_size: int) -> list:
    """The first `limit` sequences of a data directory with a full block after an anchor, with
    features (computed by `online`, an OnlineTarget, for token data). The check picks what a
    run keeps: never on data of the test prompts."""
    meta = read_meta(data_dir, tokens_ok=True)
    for_choosing(meta.get("split", ""), "the acceptance check")
    token_data = meta["format"] == TOKEN_FORMAT
    seqs = []
    for path in list_shards(data_dir):
        shard = Shard(path)
        for i in range(len(shard)):
            s = shard[i]
            if len(s.tokens) - block_size > s.prompt_len:
                seqs.append(s)
            if len(seqs) == limit:
                break
        if len(seqs) == limit:
            break
    if not seqs:
        raise ValueError(
            f"{data_dir}: no sequence has a full block of {block_size} after its prompt"
        )
    if token_data:
        if online is None:
            raise ValueError(f"{data_dir} holds token data: the check needs the target online")
        feats = online.features([s.tokens.numpy() for s in seqs])
    else:
        feats = [s.features for s in seqs]
    return [
        HeldoutSequence(
            i,
            "all",
            i,
            s.tokens.numpy().astype(np.int64),
            f.float().cpu().numpy(),
            int(s.prompt_len),
        )
        for i, (s, f) in enumerate(zip(seqs, feats))
    ]


class AcceptanceCheck:
    """fn(step) for training.trainer.run_training's `periodic`: gamma of `model` on held-out
    anchors at T = 0, per step count in `steps`, into OUT/acceptance.csv (and printed)."""

    def __init__(
        self,
        model,
        online,
        seqs: list,
        out: str | Path,
        *,
        steps: tuple[int, ...] = (1, 2),
        max_anchors: int = 8,
    ):
        """online: the run's OnlineTarget (its engine verifies; the drafter's copy is made in
        its dtype, as serving runs it). steps: the flow-map jumps measured (one for a
        DFlash-style drafter)."""
        self.model, self.engine, self.seqs = model, online.engine, seqs
        self.path = Path(out) / CSV
        self.steps, self.max_anchors = tuple(steps), max_anchors
        self.dtype, self.device = online.embed.dtype, online.device
        self.last: dict = {}

    def __call__(self, step: int) -> dict:
        from drafter_service.factory import make_proposer

        # A copy in the serving dtype: its frozen tensors stay the target's.
        m = copy_sharing_frozen(self.model).to(self.device, self.dtype).eval()
        prop = make_proposer(
            m,
            device=str(self.device),
            n_slots=min(self.engine.n_slots, len(self.seqs)),
            max_context=self.engine.max_seq_len,
        )
        row = {"step": step}
        kind = getattr(m.cfg, "kind", "flashmap")
        for n in self.steps if kind == "flashmap" else self.steps[:1]:
            res = offline_acceptance(
                self.engine,
                prop,
                self.seqs,
                temperature=0.0,
                steps=n,
                shuffles=False,
                max_anchors=self.max_anchors,
            )
            row[f"gamma_steps{n}"] = float(np.mean(res.gamma["shared"]))
        new = not self.path.is_file()
        with open(self.path, "a", newline="") as f:
            w = csv.DictWriter(f, list(row))
            if new:
                w.writeheader()
            w.writerow({k: v if k == "step" else f"{v:.4f}" for k, v in row.items()})
        print(
            f"[acceptance] step {step}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "step"),
            flush=True,
        )
        self.last = row
        return row
