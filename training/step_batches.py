"""A training step's blocks across ranks and micro-batches: which sequences each part takes,
where the data stream stands (the position a checkpoint keeps), the draws of each part, and
the parts' features (stored with the data, or computed online by the target).

Step s takes the next G = ceil(batch_size / anchors_per_seq) sequences of the stream
(training.sequence_stream.SequenceStream) from the data position, split into P = ranks x
accumulation parts of G / P sequences each: micro-batch m of rank r is part j = m * ranks + r.
Part j's anchors and noise come from generators seeded by (seed, s, j), or (seed, s) when
P = 1 as a single process always drew them, so a step's blocks depend on P only, not on how
the parts are spread over ranks and micro-batches, and never on what ran before (a resumed
run draws what the uninterrupted run drew).
"""

from __future__ import annotations

import numpy as np
import torch

from training.flow import Batch, make_batch
from training.sequence_stream import SequenceStream


def step_generator(seed: int, step: int, device, part: int | None = None) -> torch.Generator:
    """The torch generator of a step's (part's) noise and flow times."""
    key = [seed, step] if part is None else [seed, step, part]
    s = int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0]) & (2**63 - 1)
    return torch.Generator(device=device).manual_seed(s)


def anchor_rng(seed: int, step: int, part: int | None = None) -> np.random.Generator:
    """The numpy generator of a step's (part's) anchors."""
    return np.random.default_rng([seed, step, 1] if part is None else [seed, step, 1, part])


class DataPosition:
    """Sequences of the stream consumed before the next step; a checkpoint holds it (as an
    extra module of training.trainer.run_training), so a resumed run continues where the
    killed one stood even with another batch size. None until the first step: then step x G,
    the fixed mapping of runs saved before the position was kept."""

    def __init__(self):
        self.position: int | None = None

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, d: dict) -> None:
        self.position = None if d.get("position") is None else int(d["position"])


class StepBatches:
    """batch_fn of training.trainer.run_training for one rank: step -> (Batch, noise generator),
    or with accum > 1 an iterator of accum such pairs (each built when the loop reaches it).

    online: a training.online_features.OnlineTarget computing the features of token data on
    its device; None: the data hold them."""

    def __init__(
        self,
        stream,
        tcfg,
        block_size: int,
        *,
        device,
        rank: int = 0,
        world: int = 1,
        accum: int = 1,
        online=None,
    ):
        self.stream, self.tcfg, self.block_size = stream, tcfg, block_size
        self.device, self.rank, self.world, self.accum = device, rank, world, accum
        self.online = online
        self.per_step = max(1, -(-tcfg.batch_size // tcfg.anchors_per_seq))
        parts = world * accum
        if self.per_step % parts:
            raise ValueError(
                f"a step's {self.per_step} sequences (batch size {tcfg.batch_size} / "
                f"{tcfg.anchors_per_seq} anchors per sequence) do not split into {world} ranks x "
                f"{accum} micro-batches: make batch_size / anchors_per_seq a multiple of {parts}"
            )
        self.parts = parts
        self.per_part = self.per_step // parts
        self.data = DataPosition()

    def part(self, step: int, base: int, j: int) -> tuple[Batch, torch.Generator]:
        """Part j of the step whose sequences start at stream position `base`."""
        cfg, single = self.tcfg, self.parts == 1
        seqs = self.stream.take(base + j * self.per_part, self.per_part)
        where = None
        if self.online is not None:
            seqs = self.online.attach(seqs, cfg.max_len)
            where = self.online.device
        batch = make_batch(
            seqs,
            self.block_size,
            cfg.anchors_per_seq,
            cfg.max_len,
            anchor_rng(cfg.seed, step, None if single else j),
            device=where,
        ).to(self.device)
        return batch, step_generator(cfg.seed, step, self.device, None if single else j)

    def __call__(self, step: int):
        if self.data.position is None:
            self.data.position = step * self.per_step
        base = self.data.position
        self.data.position = base + self.per_step  # what the checkpoint after this step holds
        js = [m * self.world + self.rank for m in range(self.accum)]
        if self.accum == 1:
            return self.part(step, base, js[0])
        return (self.part(step, base, j) for j in js)


def flow_check_batches(data, tcfg, block_size: int, device, online=None) -> list[Batch]:
    """The fixed blocks the flow stage's check runs on: tcfg.check_batches batches of a stream
    with another seed over `data` (tcfg.check_data: held-out data; else the training data).
    online: the OnlineTarget that gives token data their features."""
    stream = SequenceStream(data, seed=tcfg.seed + 7919, max_len=tcfg.max_len)
    n = max(1, -(-tcfg.batch_size // tcfg.anchors_per_seq))
    rng = np.random.default_rng([tcfg.seed, 7919])
    out = []
    for i in range(tcfg.check_batches):
        seqs = stream.take(i * n, n)
        if online is not None and seqs[0].features is None:
            seqs = online.attach(seqs, tcfg.max_len)
        out.append(make_batch(seqs, block_size, tcfg.anchors_per_seq, tcfg.max_len, rng).to(device))
    return out
