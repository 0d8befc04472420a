"""The target engine: a Qwen3 with a slot KV cache that verifies batches of rows.

A sequence owns a slot from `allocate()` until `release(slot)`. Each `verify` call
is one forward pass over rows that may belong to different sequences at different
positions and lengths (a prefill next to a K+1-token verify round). A row writes its
tokens at start_pos .. start_pos+L-1 of its slot; starting before the slot's current
length rolls the sequence back for free (positions past start_pos are masked until
overwritten). The result per row is the verification statistics of its last K+1
positions (target_service.verification) and the feature-layer hidden states of all
its positions, which the drafter conditions on. A row with next_seeds decodes that many
more tokens in the same call (multi-step decoding), each step an ordinary one-token
forward, so the call returns what as many separate calls would.

The engine keeps every cached position's features on its device (`feature_bytes_per_token`
per position; on the host, pages committed as they are written): a row without features
(VerifyRow.features False) sends none, and a later row of the sequence asks for them from
an earlier position (VerifyRow.features_from), so a sequence that stops drafting stops
shipping features and gets them back in one row when it drafts again. Only the features a
row asks for leave the device.

On a GPU, `enable_graphs` (or `cuda_graphs=True`) runs every batch that fits a (batch,
query length) bucket as one CUDA-graph replay of the same forward (target_service.cuda_graphs);
prefill and odd shapes run eagerly. Only the argmax, the features rows ask for and, for
sampling rows, the O(K * S) statistics come back to the host.

Not thread-safe: callers (the Triton model) serialise calls.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from flashmap.host_memory import keep_freed_memory
from flashmap.types import (
    MAX_DECODE_STEPS,
    InvalidRequest,
    SamplingParams,
    VerifyResult,
    VerifyRow,
    feature_layers_for,
)
from target_service.kernels import self_check
from target_service.packing import GROUP_TOKENS, pack
from target_service.qwen3 import Qwen3, Qwen3Config, cast_features, forward_step
from target_service.verification import argmax_ids, verification_stats

DEFAULT_MAX_SEQ_LEN = 4096


class NoFreeSlot(RuntimeError):
    """Every KV-cache slot is taken; release one or retry later."""


class TargetEngine:
    def __init__(
        self,
        model_dir: str | Path,
        n_slots: int = 8,
        max_seq_len: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        feature_layers: list[int] | None = None,
        cuda_graphs: bool = False,
        features_dtype: torch.dtype = torch.float32,
    ):
        """cuda_graphs=True (on a CUDA device): capture decode / verify graphs for the default
        buckets at start-up (`enable_graphs` for other buckets or the batch-invariant mode).
        features_dtype: of the features handed back (float16 halves what travels to the drafter)."""
        model = Qwen3.from_pretrained(model_dir, device=device, dtype=dtype)
        eos = list(model.config.eos_token_id) + _generation_eos(Path(model_dir))
        self._setup(model, n_slots, max_seq_len, feature_layers, eos, cuda_graphs, features_dtype)

    @classmethod
    def from_model(
        cls,
        model: Qwen3,
        *,
        n_slots: int = 8,
        max_seq_len: int | None = None,
        feature_layers: list[int] | None = None,
        eos_token_ids: list[int] | None = None,
        cuda_graphs: bool = False,
        features_dtype: torch.dtype = torch.float32,
    ) -> TargetEngine:
        """An engine around an already loaded model (its caches are replaced)."""
        engine = cls.__new__(cls)
        eos = list(model.config.eos_token_id) if eos_token_ids is None else list(eos_token_ids)
        engine._setup(model, n_slots, max_seq_len, feature_layers, eos, cuda_graphs, features_dtype)
        return engine

    def _setup(
        self,
        model: Qwen3,
        n_slots,
        max_seq_len,
        feature_layers,
        eos: list[int],
        cuda_graphs=False,
        features_dtype: torch.dtype = torch.float32,
    ) -> None:
        c = model.config
        if max_seq_len is None:
            max_seq_len = min(c.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
        if n_slots < 1 or max_seq_len < 1:
            raise ValueError(f"n_slots and max_seq_len must be >= 1, got {n_slots}, {max_seq_len}")
        layers = (
            feature_layers_for(c.num_hidden_layers)
            if feature_layers is None
            else [int(l) for l in feature_layers]
        )
        if any(not 0 <= l < c.num_hidden_layers for l in layers) or len(set(layers)) != len(layers):
            raise ValueError(
                f"feature_layers must be distinct layers in [0, {c.num_hidden_layers}), got {layers}"
            )
        model.setup_caches(n_slots, max_seq_len)
        self.model = model
        self._feature_layers = tuple(layers)
        # Every cached position's features (rows without features, features_from), [slots, positions, F].
        shape, dev = (
            (n_slots, max_seq_len, len(layers) * c.hidden_size),
            model.lm_head.weight.device,
        )
        self._features_np = (
            np.float16 if features_dtype == torch.float16 else np.float32
        )  # on the host
        if (
            dev.type == "cpu"
        ):  # numpy's zeros leave untouched pages unmapped; torch's would write them all
            self._features = torch.from_numpy(np.zeros(shape, self._features_np))
        else:
            self._features = torch.zeros(shape, dtype=features_dtype, device=dev)
        self._eos = list(dict.fromkeys(eos))  # dedupe, keep order
        self._allocated = [False] * n_slots
        self._length = [0] * n_slots
        w = model.lm_head.weight
        self._device, self._dtype = w.device, w.dtype
        # Cast by torch where the features are made (on the device before a GPU's copy): numpy's
        # float16 casts cost ~6x torch's.
        self.features_dtype = features_dtype
        if w.device.type == "cpu":
            keep_freed_memory()  # the step's buffers stay mapped (flashmap.host_memory)
        self.graphs = None  # TargetGraphs after enable_graphs()
        self.group_tokens = (
            GROUP_TOKENS  # eager verifies: rows grouped for attention (target_service.packing)
        )
        self.kernel_check: dict = {}  # the fused kernels' self-check on this device (kernels.self_check)
        if w.device.type == "cuda":
            self.kernel_check = self_check(
                model.ops,
                dtype=w.dtype,
                device=w.device,
                n_heads=c.num_attention_heads,
                n_kv=c.num_key_value_heads,
                head_dim=c.head_dim,
                hidden=c.hidden_size,
                intermediate=c.intermediate_size,
            )
        if cuda_graphs and w.device.type == "cuda":
            self.enable_graphs()

    def enable_graphs(
        self,
        batch_buckets: tuple[int, ...] | None = None,
        query_buckets: tuple[int, ...] | None = None,
        context_buckets: tuple[int, ...] | None = None,
        mode: str = "cuda",
        batch_invariant: bool = False,
    ) -> dict:
        """Run decode / verify passes that fit a bucket through captured CUDA graphs
        (target_service.cuda_graphs); mode="static" runs the same padded function without
        capture (CPU tests). batch_invariant=True: one graph of the largest shape for every
        pass, so logits do not depend on the batch (bit-identical speculative and plain
        decoding) at the cost of that shape. Returns the capture report."""
        from target_service.cuda_graphs import TargetGraphs

        self.graphs = None
        graphs = TargetGraphs(
            self.model,
            self._feature_layers,
            self.n_slots,
            batch_buckets,
            query_buckets,
            context_buckets,
            mode=mode,
            batch_invariant=batch_invariant,
            features_dtype=self.features_dtype,
        )
        report = graphs.capture()
        self.graphs = graphs
        return report

    def disable_graphs(self) -> None:
        self.graphs = None

    # -- description -----------------------------------------------------------------
    @property
    def config(self) -> Qwen3Config:
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def feature_layers(self) -> list[int]:
        return list(self._feature_layers)

    @property
    def feature_dim(self) -> int:
        return len(self._feature_layers) * self.hidden_size

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len

    @property
    def packed_verify(self) -> bool:
        """True: a decode round costs about its rows' total tokens (eager, packed); False: it
        runs in a CUDA graph padded to [batch bucket, longest row]. The controller prices plans so."""
        return self.graphs is None

    @property
    def n_slots(self) -> int:
        return len(self._allocated)

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos)

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.config
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * self._dtype.itemsize

    @property
    def feature_bytes_per_token(self) -> int:
        """Memory the kept features take per cached position (on the engine's device)."""
        return self._features.shape[-1] * self._features.element_size()

    @property
    def free_slots(self) -> int:
        return self._allocated.count(False)

    # -- slots -----------------------------------------------------------------------
    def allocate(self) -> int:
        """Take a free slot (its length starts at 0)."""
        try:
            slot = self._allocated.index(False)
        except ValueError:
            raise NoFreeSlot(f"all {self.n_slots} KV-cache slots are in use") from None
        self._allocated[slot] = True
        self._length[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        """Free a slot. Releasing a free slot is an error: it would hide a double release
        that, after reuse, frees another sequence's slot."""
        self._check_slot(slot)
        self._allocated[slot] = False
        self._length[slot] = 0

    def length(self, slot: int) -> int:
        """Tokens currently held by an allocated slot."""
        self._check_slot(slot)
        return self._length[slot]

    def _check_slot(self, slot: int, where: str = "") -> None:
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.n_slots:
            raise InvalidRequest(f"{where}slot {slot!r} out of range [0, {self.n_slots})")
        if not self._allocated[slot]:
            raise InvalidRequest(f"{where}slot {slot} is not allocated")

    # -- verify ----------------------------------------------------------------------
    def verify(self, rows: list[VerifyRow]) -> list[VerifyResult]:
        """One forward pass for all rows, and one more per further step of the rows with
        next_seeds (the steps of all such rows batched); see the module docstring. Validates every row
        before touching any cache. A batch that fits a captured bucket (enable_graphs) runs
        in its graph, padded; others (prefill, odd shapes, every batch without graphs) run
        eagerly, packed (target_service.packing). In batch-invariant mode the rows that fit
        run in the graph and the others in a second, eager pass."""
        if not rows:
            return []
        rows = self._validate(rows)
        out = self._forward(rows)
        more = [i for i, r in enumerate(rows) if len(r.next_seeds)]
        out = self._decode_more(rows, out, more) if more else out
        for i, r in enumerate(rows):
            if 0 <= r.features_from < r.start_pos:  # the kept features before the row
                kept = self._features[r.slot, r.features_from : r.start_pos].cpu().numpy()
                out[i] = dataclasses.replace(
                    out[i], features=np.concatenate([kept, out[i].features])
                )
        return out

    def _keep_features(
        self, rows: list[VerifyRow], features: torch.Tensor, src: list[np.ndarray]
    ) -> list[np.ndarray]:
        """Keep each row's features, rows src[i] of `features` ([T, F] on the device, in
        features_dtype), at its positions (one scatter for all rows); returns each row's
        features on the host, [len(src[i]), F], or none ([0, F]) for a row that does not ask."""
        dev = features.device
        slot = np.concatenate([np.full(len(i), r.slot) for r, i in zip(rows, src)])
        pos = np.concatenate([r.start_pos + np.arange(len(i)) for r, i in zip(rows, src)])
        self._features[torch.as_tensor(slot, device=dev), torch.as_tensor(pos, device=dev)] = (
            features[torch.as_tensor(np.concatenate(src), device=dev)]
        )
        asked = [i for r, i in zip(rows, src) if r.features]
        host = np.zeros((0, features.shape[1]), self._features_np)
        if asked:  # one copy off the device for every row that asks
            host = features[torch.as_tensor(np.concatenate(asked), device=dev)].cpu().numpy()
        parts = iter(np.split(host, np.cumsum([len(i) for i in asked])[:-1]))
        return [next(parts) if r.features else host[:0] for r in rows]

    def _decode_more(
        self, rows: list[VerifyRow], out: list[VerifyResult], more: list[int]
    ) -> list[VerifyResult]:
        """The further steps of the rows in `more` (next_seeds): each step one forward of those
        rows, one token each, fed the token the step before produced (argmax at T = 0, the
        residual sample otherwise); the results are joined per row (VerifyResult)."""
        parts = {i: [out[i]] for i in more}
        for j in range(max(len(rows[i].next_seeds) for i in more)):
            live = [i for i in more if j < len(rows[i].next_seeds)]
            step = []
            for i in live:
                r, last = rows[i], parts[i][-1]
                token = last.decoded(r.params.greedy)[-1]
                step.append(
                    VerifyRow(
                        r.slot,
                        self._length[r.slot],
                        np.array([token], np.int64),
                        r.params,
                        round_seed=int(r.next_seeds[j]),
                        features=r.features,
                    )
                )
            for i, res in zip(live, self._forward(step)):
                parts[i].append(res)
        for i, p in parts.items():
            out[i] = VerifyResult(
                np.concatenate([x.argmax for x in p]),
                p[0].support_probs,
                p[0].complement,
                np.concatenate([x.residual for x in p]),
                np.concatenate([x.features for x in p]),
            )
        return out

    def _forward(self, rows: list[VerifyRow]) -> list[VerifyResult]:
        """One forward pass for validated rows (next_seeds aside)."""
        lengths = [len(r.tokens) for r in rows]
        kv_len = max(r.start_pos + n for r, n in zip(rows, lengths))
        out: list[VerifyResult | None] = [None] * len(rows)
        try:
            with torch.inference_mode():
                key = (
                    self.graphs.key_for(len(rows), max(lengths), kv_len)
                    if self.graphs is not None
                    else None
                )
                if key is not None:
                    out = self._verify_graph(rows, key)
                elif self.graphs is not None and self.graphs.batch_invariant:
                    q = self.graphs.query_buckets[-1]
                    short = [i for i, n in enumerate(lengths) if n <= q]
                    long = [i for i, n in enumerate(lengths) if n > q]
                    for part in (short, long):
                        if not part:
                            continue
                        sub = [rows[i] for i in part]
                        k = (
                            self.graphs.key_for(
                                len(sub),
                                max(lengths[i] for i in part),
                                max(r.start_pos + len(r.tokens) for r in sub),
                            )
                            if part is short
                            else None
                        )
                        for i, r in zip(
                            part, self._verify_graph(sub, k) if k else self._verify_eager(sub)
                        ):
                            out[i] = r
                else:
                    out = self._verify_eager(rows)
        except BaseException:
            # The cache may be half written from start_pos on: keep only what is intact.
            for r in rows:
                self._length[r.slot] = min(self._length[r.slot], r.start_pos)
            raise
        for r, n in zip(rows, lengths):
            self._length[r.slot] = r.start_pos + n
        return out

    def _verify_eager(self, rows: list[VerifyRow]) -> list[VerifyResult]:
        p = pack(rows, self._device, self.group_tokens)
        logits, features = forward_step(
            self.model,
            p.tokens,
            p.positions,
            p.write_slot,
            p.positions,
            p.groups,
            p.logit_rows,
            None,
            self._feature_layers,
        )
        stats = verification_stats(logits, rows)
        starts = np.concatenate([[0], np.cumsum(p.lengths)[:-1]])
        feats = self._keep_features(
            rows,
            cast_features(features, self.features_dtype),
            [s + np.arange(n) for s, n in zip(starts, p.lengths)],
        )
        return [VerifyResult(*s, features=f) for s, f in zip(stats, feats)]

    def _verify_graph(self, rows: list[VerifyRow], key) -> list[VerifyResult]:
        """The same pass through a graph bucket: logits stay on the device (statistics of
        sampling rows are computed there), argmax and features come back."""
        b, q, _ = key
        tokens, positions, slots, valid, _ = _pack(rows, max(len(r.tokens) for r in rows))
        positions = np.where(valid, positions, -1)
        logits, argmax, feats = self.graphs.run(key, tokens, positions, slots)
        starts = [i * q + len(r.tokens) - r.num_draft - 1 for i, r in enumerate(rows)]
        stats = verification_stats(logits, rows, argmax=argmax, starts=starts)
        own = self._keep_features(
            rows, feats, [i * q + np.arange(len(r.tokens)) for i, r in enumerate(rows)]
        )
        return [VerifyResult(*s, features=f) for s, f in zip(stats, own)]

    def verify_tree(self, row: VerifyRow, branches: list[np.ndarray]) -> tuple[VerifyResult, int]:
        """Greedy (T = 0) verification of several draft blocks after one anchor, in one pass.

        row is the sequence's ordinary round, [.., anchor, d_1..d_K] (branch 0); branches are
        more blocks of K tokens drafted after the same anchor. They are written after the row
        at their own cache indices, with RoPE at their positions in the sequence and a tree
        mask (each sees the context, the anchor and its own prefix), so every branch gets the
        logits a plain verify of it would get. The branch with the longest prefix equal to the
        target's argmax wins (the first on ties); its K/V entries are moved to the row's
        positions, leaving the cache exactly as after `verify` of that branch alone. Returns
        (that branch's VerifyResult, its index)."""
        (row,) = self._validate([row])
        if len(row.next_seeds):
            raise InvalidRequest("tree verification decodes one step: next_seeds must be empty")
        if not row.params.greedy:
            raise InvalidRequest("tree verification is greedy-only (temperature 0)")
        K, n = row.num_draft, len(row.tokens)
        blocks = [np.asarray(b, np.int64) for b in branches]
        if K == 0 and blocks:
            raise InvalidRequest("tree verification needs a drafted row (num_draft > 0)")
        for i, b in enumerate(blocks):
            if b.shape != (K,) or ((b < 0) | (b >= self.vocab_size)).any():
                raise InvalidRequest(
                    f"branch {i + 1}: need {K} token ids in [0, {self.vocab_size}), got {b.tolist()}"
                )
        total = n + K * len(blocks)
        if row.start_pos + total > self.max_seq_len:
            raise InvalidRequest(
                f"start_pos + tree tokens = {row.start_pos + total} > max_seq_len {self.max_seq_len}"
            )
        anchor = row.start_pos + n - K - 1  # the anchor's position
        seq_pos = np.concatenate(
            [row.start_pos + np.arange(n)] + [anchor + 1 + np.arange(K)] * len(blocks)
        )
        cache_pos = row.start_pos + np.arange(total)
        # Visible: cache indices up to the anchor, then the query's own branch up to itself.
        branch_start = np.concatenate(
            [np.full(n, anchor + 1)]
            + [np.full(K, row.start_pos + n + i * K) for i in range(len(blocks))]
        )
        j = np.arange(row.start_pos + total)
        mask = (j[None] <= cache_pos[:, None]) & (
            (j[None] <= anchor) | (j[None] >= branch_start[:, None])
        )
        dev = self._device
        tokens = torch.as_tensor(np.concatenate([row.tokens, *blocks]), device=dev)[None]
        want = np.zeros(total, bool)
        want[n - K - 1 :] = True  # the anchor, branch 0 and the other branches
        try:
            with torch.inference_mode():
                logits, features = self.model(
                    tokens,
                    torch.as_tensor(seq_pos, device=dev)[None],
                    torch.tensor([row.slot], device=dev),
                    torch.ones(1, total, dtype=torch.bool, device=dev),
                    torch.as_tensor(want, device=dev)[None],
                    self._feature_layers,
                    row.start_pos + total,
                    torch.as_tensor(cache_pos, device=dev)[None],
                    torch.as_tensor(mask, device=dev)[None, None],
                )
        except BaseException:
            self._length[row.slot] = min(self._length[row.slot], row.start_pos)
            raise
        top = argmax_ids(logits)  # [1 + K * (1 + len(blocks))]
        drafts = [row.tokens[n - K :], *blocks]
        argmax = [
            np.concatenate([top[:1], top[1 + i * K : 1 + (i + 1) * K]]) for i in range(len(drafts))
        ]
        accepted = [int(np.cumprod(d == a[:K]).sum()) for d, a in zip(drafts, argmax)]
        best = int(np.argmax(accepted))
        keep = (
            np.concatenate([np.arange(n - K), n + (best - 1) * K + np.arange(K)])
            if best
            else np.arange(n)
        )
        if best:  # move the winner's K/V to the row's draft positions
            src = torch.as_tensor(row.start_pos + keep[n - K :], device=dev)
            dst = torch.arange(anchor + 1, anchor + 1 + K, device=dev)
            for layer in self.model.model.layers:
                c = layer.self_attn.kv_cache
                c.k[row.slot, :, dst] = c.k[row.slot, :, src]
                c.v[row.slot, :, dst] = c.v[row.slot, :, src]
        self._length[row.slot] = row.start_pos + n
        (feats,) = self._keep_features(
            [row], cast_features(features, self.features_dtype).reshape(total, -1), [keep]
        )
        S = row.support_ids.shape[1]
        result = VerifyResult(
            argmax[best],
            np.zeros((0, S), np.float32),
            np.zeros(0, np.float32),
            np.full(K + 1, -1, np.int64),
            features=feats,
        )
        return result, best

    def _validate(self, rows: list[VerifyRow]) -> list[VerifyRow]:
        """Raise InvalidRequest (one line, naming the row) for any bad row; return the rows
        with tokens [L] and support_ids [K, S] as int64 arrays."""
        seen: set[int] = set()
        out = []
        V = self.vocab_size
        for i, r in enumerate(rows):
            where = f"row {i}: "
            self._check_slot(r.slot, where)
            if r.slot in seen:
                raise InvalidRequest(f"{where}slot {r.slot} appears twice in one verify batch")
            seen.add(r.slot)
            t = np.asarray(r.tokens)
            if t.ndim != 1 or t.size == 0:
                raise InvalidRequest(
                    f"{where}tokens must be a non-empty 1-D array, got shape {t.shape}"
                )
            if not np.issubdtype(t.dtype, np.integer):
                raise InvalidRequest(f"{where}tokens must be integers, got dtype {t.dtype}")
            bad = t[(t < 0) | (t >= V)]
            if bad.size:
                raise InvalidRequest(
                    f"{where}token id {int(bad[0])} outside the vocabulary [0, {V})"
                )
            n, start, have = len(t), r.start_pos, self._length[r.slot]
            if not 0 <= start <= have:
                raise InvalidRequest(
                    f"{where}start_pos {start} outside [0, {have}] (the slot holds {have} tokens)"
                )
            if start + n > self.max_seq_len:
                raise InvalidRequest(
                    f"{where}start_pos + len(tokens) = {start + n} > max_seq_len {self.max_seq_len}"
                )
            if not isinstance(r.params, SamplingParams):
                raise InvalidRequest(
                    f"{where}params must be SamplingParams, got {type(r.params).__name__}"
                )
            try:
                r.params.validate()
            except InvalidRequest as e:
                raise InvalidRequest(f"{where}{e}") from None
            sup = self._validate_support(r.support_ids, n, where)
            seeds = np.asarray(r.next_seeds)
            if seeds.ndim != 1 or not (np.issubdtype(seeds.dtype, np.integer) or seeds.size == 0):
                raise InvalidRequest(
                    f"{where}next_seeds must be a 1-D integer array, got shape {seeds.shape}"
                )
            if seeds.size:
                if sup.shape[0]:
                    raise InvalidRequest(
                        f"{where}a row with drafts decodes one step: next_seeds must be empty"
                    )
                if seeds.size >= MAX_DECODE_STEPS:
                    raise InvalidRequest(
                        f"{where}{seeds.size + 1} decode steps; at most {MAX_DECODE_STEPS}"
                    )
                if start + n + seeds.size > self.max_seq_len:
                    raise InvalidRequest(
                        f"{where}start_pos + len(tokens) + len(next_seeds) = {start + n + seeds.size}"
                        f" > max_seq_len {self.max_seq_len}"
                    )
            ff = r.features_from
            if (
                not isinstance(ff, (int, np.integer))
                or not -1 <= ff <= start
                or (ff >= 0 and not r.features)
            ):
                raise InvalidRequest(
                    f"{where}features_from {ff!r}: -1, or a position in [0, start_pos {start}] "
                    "of a row with features"
                )
            out.append(
                dataclasses.replace(
                    r,
                    tokens=t.astype(np.int64, copy=False),
                    support_ids=sup,
                    next_seeds=seeds.astype(np.int64, copy=False),
                )
            )
        return out

    def _validate_support(self, sup: np.ndarray, n_tokens: int, where: str) -> np.ndarray:
        sup = np.asarray(sup)
        if sup.ndim != 2 or not (np.issubdtype(sup.dtype, np.integer) or sup.size == 0):
            raise InvalidRequest(
                f"{where}support_ids must be a 2-D integer array [K, S], got shape {sup.shape}"
            )
        K = sup.shape[0]
        if K + 1 > n_tokens:
            raise InvalidRequest(
                f"{where}{K} draft tokens need at least {K + 1} input tokens, got {n_tokens}"
            )
        bad = sup[(sup < -1) | (sup >= self.vocab_size)]
        if bad.size:
            raise InvalidRequest(f"{where}support id {int(bad[0])} outside [-1, {self.vocab_size})")
        # Sorted, a repeat is two equal neighbours; padding (-1) may repeat. One vectorised
        # test: a loop of np.unique per slot cost ~70 us per 16-slot verify.
        srt = np.sort(sup, axis=1)
        dup = ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(axis=1)  # [K]
        if dup.any():
            raise InvalidRequest(f"{where}support_ids[{int(dup.argmax())}] repeats a token id")
        return sup.astype(np.int64, copy=False)


def _pack(rows: list[VerifyRow], L: int) -> tuple[np.ndarray, ...]:
    """Right-padded model inputs: tokens, positions [B, L], slots [B], valid and
    want-logits masks [B, L] (the last K+1 positions of each row)."""
    B = len(rows)
    tokens, positions = np.zeros((B, L), np.int64), np.zeros((B, L), np.int64)
    valid, want_logits = np.zeros((B, L), bool), np.zeros((B, L), bool)
    for b, r in enumerate(rows):
        n = len(r.tokens)
        tokens[b, :n] = r.tokens
        positions[b, :n] = r.start_pos + np.arange(n)
        valid[b, :n] = True
        want_logits[b, n - r.num_draft - 1 : n] = True
    slots = np.array([r.slot for r in rows], np.int64)
    return tokens, positions, slots, valid, want_logits


def _generation_eos(model_dir: Path) -> list[int]:
    """Extra stop ids from generation_config.json (Qwen3 lists <|endoftext|> there too)."""
    try:
        eos = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError, AttributeError):
        return []
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
