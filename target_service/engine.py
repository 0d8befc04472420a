"""The target engine: a Qwen3 with a slot KV cache that verifies batches of rows.

A sequence owns a slot from `allocate()` until `release(slot)`. Each `verify` call
is one forward pass over rows that may belong to different sequences at different
positions and lengths (a prefill next to a K+1-token verify round). A row writes its
tokens at start_pos .. start_pos+L-1 of its slot; starting before the slot's current
length rolls the sequence back for free (positions past start_pos are masked until
overwritten). The result per row is the verification statistics of its last K+1
positions (target_service.verification) and the feature-layer hidden states of all
its positions, which the drafter conditions on. A row with next_seeds decodes that many
more tokens in the same call (multi-step decoding, target_service.multi_step), each step an
ordinary one-token forward, so the call returns what as many separate calls would.

The engine keeps every cached position's features on its device (target_service.kept_features,
`feature_bytes_per_token` per position; on the host, pages committed as they are written): a
row without features (VerifyRow.features False) sends none, and a later row of the sequence
asks for them from an earlier position (VerifyRow.features_from), so a sequence that stops
drafting stops shipping features and gets them back in one row when it drafts again. Only the
features a row asks for leave the device.

On a GPU, `enable_graphs` (or `cuda_graphs=True`) runs every batch that fits a (batch,
query length) bucket as one CUDA-graph replay of the same forward (target_service.cuda_graphs);
prefill and odd shapes run eagerly. Only the argmax, the features rows ask for and, for
sampling rows, the O(K * S) statistics come back to the host.

Not thread-safe: callers (the Triton model) serialise calls.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from flashmap.drafter_inputs import ContextProjection
from flashmap.host_memory import keep_freed_memory
from flashmap.types import VerifyResult, VerifyRow, feature_layers_for
from target_service.kept_features import KeptFeatures, join_features
from target_service.kernels import self_check
from target_service.multi_step import decode_more
from target_service.packing import GROUP_TOKENS, pack, padded_inputs
from target_service.qwen3 import Qwen3, forward_step
from target_service.qwen3_config import Qwen3Config, generation_eos
from target_service.row_checks import check_slot, check_tree, validate_rows
from target_service.tree import verify_trees
from target_service.verification import logprob_stats, verification_stats

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
        context_projection: ContextProjection | None = None,
    ):
        """cuda_graphs=True (on a CUDA device): capture decode / verify graphs for the default
        buckets at start-up (`enable_graphs` for other buckets or the batch-invariant mode).
        features_dtype: of the features handed back (float16 halves what travels to the drafter).
        context_projection: the drafter's first step (flashmap.drafter_inputs), applied to the
        features before they are kept and handed back."""
        model = Qwen3.from_pretrained(model_dir, device=device, dtype=dtype)
        eos = list(model.config.eos_token_id) + generation_eos(Path(model_dir))
        self._setup(
            model,
            n_slots,
            max_seq_len,
            feature_layers,
            eos,
            cuda_graphs,
            features_dtype,
            context_projection,
        )

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
        context_projection: ContextProjection | None = None,
    ) -> TargetEngine:
        """An engine around an already loaded model (its caches are replaced)."""
        engine = cls.__new__(cls)
        eos = list(model.config.eos_token_id) if eos_token_ids is None else list(eos_token_ids)
        engine._setup(
            model,
            n_slots,
            max_seq_len,
            feature_layers,
            eos,
            cuda_graphs,
            features_dtype,
            context_projection,
        )
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
        context_projection: ContextProjection | None = None,
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
        w = model.lm_head.weight
        # Every cached position's features (rows without features, features_from), projected
        # by the drafter's first step when there is one.
        self.kept = KeptFeatures(
            n_slots,
            max_seq_len,
            len(layers),
            c.hidden_size,
            w.dtype,
            w.device,
            features_dtype,
            context_projection,
        )
        self._eos = list(dict.fromkeys(eos))  # dedupe, keep order
        self._allocated = [False] * n_slots
        self._length = [0] * n_slots
        self._device, self._dtype = w.device, w.dtype
        if w.device.type == "cpu":
            keep_freed_memory()  # the step's buffers stay mapped (flashmap.host_memory)
        self.graphs = None  # TargetGraphs after enable_graphs()
        self._device_features = False  # during a verify(features_on_device=True)
        # Eager verifies: rows grouped for attention (target_service.packing).
        self.group_tokens = GROUP_TOKENS
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
        """Width of the features handed back: the layers' hidden states, or their projection."""
        return self.kept.width

    @property
    def features_dtype(self) -> torch.dtype:
        return self.kept.features_dtype

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
        return self.kept.bytes_per_token

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
        check_slot(slot, self._allocated)
        self._allocated[slot] = False
        self._length[slot] = 0

    def length(self, slot: int) -> int:
        """Tokens currently held by an allocated slot."""
        check_slot(slot, self._allocated)
        return self._length[slot]

    # -- verify ----------------------------------------------------------------------
    def verify(self, rows: list[VerifyRow], features_on_device: bool = False) -> list[VerifyResult]:
        """One forward pass for all rows, and one more per further step of the rows with
        next_seeds (the steps of all such rows batched); see the module docstring. Validates every row
        before touching any cache. A batch that fits a captured bucket (enable_graphs) runs
        in its graph, padded; others (prefill, odd shapes, every batch without graphs) run
        eagerly, packed (target_service.packing). In batch-invariant mode the rows that fit
        run in the graph and the others in a second, eager pass. features_on_device: the
        results' features stay on the engine's device (tensors; the in-process drafter reads
        them there), else they come back as numpy."""
        if not rows:
            return []
        rows = self._validate(rows)
        self._device_features = features_on_device
        try:
            out = self._forward(rows)
            more = [i for i, r in enumerate(rows) if len(r.next_seeds)]
            out = decode_more(self._forward, self._length, rows, out, more) if more else out
        finally:
            self._device_features = False
        for i, r in enumerate(rows):
            if 0 <= r.features_from < r.start_pos:  # the kept features before the row
                kept = self.kept.before(r.slot, r.features_from, r.start_pos, features_on_device)
                out[i] = dataclasses.replace(
                    out[i], features=join_features([kept, out[i].features])
                )
        return out

    def _keep_features(
        self, rows: list[VerifyRow], features: torch.Tensor, src: list[np.ndarray]
    ) -> list[np.ndarray | torch.Tensor]:
        """KeptFeatures.keep, handing back on the device during a verify(features_on_device)."""
        return self.kept.keep(rows, features, src, self._device_features)

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
        logprobs = logprob_stats(logits, rows, stats)
        starts = np.concatenate([[0], np.cumsum(p.lengths)[:-1]])
        feats = self._keep_features(
            rows,
            features,
            [s + np.arange(n) for s, n in zip(starts, p.lengths)],
        )
        return [VerifyResult(*s, f, *lp) for s, f, lp in zip(stats, feats, logprobs)]

    def _verify_graph(self, rows: list[VerifyRow], key) -> list[VerifyResult]:
        """The same pass through a graph bucket: logits stay on the device (statistics of
        sampling rows are computed there), argmax and features come back."""
        b, q, _ = key
        tokens, positions, slots, valid, _ = padded_inputs(rows, max(len(r.tokens) for r in rows))
        positions = np.where(valid, positions, -1)
        logits, argmax, feats = self.graphs.run(key, tokens, positions, slots)
        starts = [i * q + len(r.tokens) - r.num_draft - 1 for i, r in enumerate(rows)]
        stats = verification_stats(logits, rows, argmax=argmax, starts=starts)
        logprobs = logprob_stats(logits, rows, stats, starts)
        own = self._keep_features(
            rows, feats, [i * q + np.arange(len(r.tokens)) for i, r in enumerate(rows)]
        )
        return [VerifyResult(*s, f, *lp) for s, f, lp in zip(stats, own, logprobs)]

    def verify_trees(
        self, rows: list[VerifyRow], features_on_device: bool = False
    ) -> list[tuple[VerifyResult, np.ndarray]]:
        """Verification of rows whose drafts form trees (VerifyRow.parents), all in one pass
        (target_service.tree), at any temperature: per row the accepted path's result and the
        path, the cache exactly as after `verify` of that path alone. features_on_device: as
        in `verify`."""
        rows = self._validate(rows)
        for row in rows:
            check_tree(row)
        self._device_features = features_on_device
        try:
            return verify_trees(self, rows)
        finally:
            self._device_features = False

    def verify_tree(
        self, row: VerifyRow, features_on_device: bool = False
    ) -> tuple[VerifyResult, np.ndarray]:
        """One tree row (verify_trees)."""
        return self.verify_trees([row], features_on_device)[0]

    def _validate(self, rows: list[VerifyRow]) -> list[VerifyRow]:
        return validate_rows(rows, self._allocated, self._length, self.vocab_size, self.max_seq_len)
