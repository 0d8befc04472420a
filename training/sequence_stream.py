"""The data stream every drafter trainer reads: a deterministic endless stream of sequences over
the shards of drafter data (training.drafter_data), and the check that the data were made for
the drafter's target.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np

from training.drafter_data import Shard, list_shards, shard_index


class SequenceStream:
    """A deterministic endless stream of sequences over the shards: epoch e visits the
    shards in a seeded order and each shard's sequences in a seeded order. Position p of
    the stream depends only on (seed, p), so a resumed run sees the same data.
    Only sequences with an anchor inside the response (after cutting to max_len) are used."""

    def __init__(
        self, data_dir: str | Path, seed: int = 0, max_len: int | None = None, cache_shards: int = 2
    ):
        self.shards = list_shards(data_dir)
        self.index = []  # per shard: the usable sequence numbers
        for path in self.shards:
            offsets, prompt_lens = shard_index(path)
            lengths = np.diff(offsets)
            if max_len is not None:
                lengths = np.minimum(lengths, max_len)
            self.index.append(np.nonzero(lengths - 2 >= prompt_lens)[0])
        self.counts = [len(ix) for ix in self.index]
        self.total = sum(self.counts)
        if self.total == 0:
            raise ValueError(
                f"{data_dir}: no sequence has a response of >= 2 tokens within max_len {max_len}"
            )
        self.seed = seed
        self._cache: OrderedDict[int, Shard] = OrderedDict()
        self._cache_size = cache_shards

    def _shard(self, i: int) -> Shard:
        if i in self._cache:
            self._cache.move_to_end(i)
        else:
            self._cache[i] = Shard(self.shards[i])
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return self._cache[i]

    def get(self, p: int):
        epoch, r = divmod(p, self.total)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
        for i in order:
            if r < self.counts[i]:
                idx = self.index[i][
                    np.random.default_rng([self.seed, epoch, int(i)]).permutation(self.counts[i])[r]
                ]
                return self._shard(int(i))[int(idx)]
            r -= self.counts[i]
        raise AssertionError("unreachable")

    def take(self, start: int, n: int) -> list:
        return [self.get(p) for p in range(start, start + n)]


def check_data(meta: dict, model_cfg) -> None:
    """Refuse drafter data (their meta.json) made for another target than the drafter's config."""
    if meta["target_vocab_size"] != model_cfg.vocab_size:
        raise ValueError(
            f"data vocab {meta['target_vocab_size']} != drafter vocab {model_cfg.vocab_size}"
        )
    if list(meta["feature_layers"]) != list(model_cfg.feature_layers):
        raise ValueError(
            f"data feature layers {meta['feature_layers']} != drafter's {model_cfg.feature_layers}"
        )
    if meta.get("embed_hash") and meta["embed_hash"] != model_cfg.embed_hash:
        raise ValueError("the data were made with another target (embedding hash differs)")
