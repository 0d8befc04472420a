"""Serving-side FlashMap / DFlash-style proposer: per-sequence cache + batched drafting.

Each sequence gets a slot in static cache buffers holding its projected cross-attention
K/V per DiT block ([n_blocks, n_slots, h, max_context, d]); `extend` projects and writes
only the new positions. `propose` drafts one block per request with ONE batched forward
per flow step:

    steps = 1:  one flow-map jump 0 -> 1
    steps = 2:  0 -> t(tau = 1/2) -> 1 (two jumps)
    steps >= 3: N Euler steps of the teacher ODE (diagonal s = t) on a grid uniform in tau
    dflash:     one pass over the masked block, whatever the step count

The flow runs on the embedded state y = x @ E [B, K, H] (flow_map: the network sees x
only through it), so the noise is y_0 = z @ F (F^T F = E^T E), distributed as x_0 @ E.
Randomness is per request, from generators seeded with the request's seed: z (one [r]
draw shared by all K slots, the paper's, or [K, r] with shared_noise=False; r = min(V, H))
comes from a
generator on the drafter's device (on CUDA a Philox generator per request: no host draw
and no host-to-device copy per request, so a batch of 16 costs what one does), the
proposal samples from a CPU generator. Drafts are reproducible for a seed and
independent of batching on a given device; the CPU and CUDA draws differ (other
generators), and CUDA draws may differ between GPU models (torch's kernels lay out
Philox offsets by the device's size) and torch versions. On the CPU both come from one
generator, as before. At temperature T > 0 slot k proposes x_k ~ q_k = softmax(logits/T)
restricted to its top-m tokens and renormalised; the support sent to the target is those
m ids with their q (docs/ARCHITECTURE.md, exact speculative sampling).

By default every row drafts as the paper does: the flow from its noise, 1 or 2 jumps of the
map. Departures, each named (FlashMapProposer's options, `departures_as_trained`): greedy rows
(temperature 0) may draft mode-seeking instead of sampling the flow (`greedy_estimate`,
`greedy_noise_scale`): at T = 0 the target accepts a slot only when it is the target's argmax,
and a flow that samples its joint is right in slot k with about the probability it gives the
right token, while a per-slot argmax is right whenever that token is the mode. greedy_estimate
= "argmax" moves the state between steps towards the one-hot argmax of the denoiser instead of
its softmax; greedy_noise_scale < 1 starts from scaled-down noise (0: the zero state, which a
map distilled with zero-state jumps, DrafterConfig.null_jump_fraction, was trained from).
With second_jump_net, a checkpoint's second-jump network (DrafterConfig.second_jump_net)
drafts the second of two jumps of such rows, on the path it was trained on (the zero state and
its estimate; research.second_jump_refiner); those batches run eagerly beside
CUDA graphs. None of this touches rows with T > 0: their proposal q is what the flow samples.
Not thread-safe: the gRPC server serialises calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from drafter_service.dit_blocks import CrossContext
from drafter_service.flashmap_dit import FlashMapDiT
from drafter_service.flow_map import greedy_summary, jump
from drafter_service.slots import ContextTooLong, ProposerError, SlotCacheProposer, SlotsExhausted  # noqa: F401
from flashmap.drafts import Draft, ProposeRequest
from flashmap.types import DRAFT_STEPS, ESTIMATES


def request_generator(
    seed: int, block: int = 0, device: str | torch.device = "cpu"
) -> torch.Generator:
    """Generator (CPU by default) of one request's randomness; block b > 0 (propose_blocks)
    gets an independent stream, block 0 is the plain `propose` stream."""
    if block == 0:
        s = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
    else:
        s = int(
            np.random.SeedSequence([int(seed) & 0xFFFF_FFFF_FFFF_FFFF, block]).generate_state(
                1, np.uint64
            )[0]
        )
    return torch.Generator(device=device).manual_seed(s)


def draw_noise(gen: torch.Generator, block_size: int, dim: int, shared: bool = True) -> Tensor:
    """Standard normal noise for one block on the generator's device: [K, dim] float32; with
    shared=True one [dim] draw repeated over the K slots."""
    if shared:
        return torch.randn(dim, generator=gen, device=gen.device).expand(block_size, dim)
    return torch.randn(block_size, dim, generator=gen, device=gen.device)


@dataclass
class _Row:
    """One block to draft: which cache slot (-1: no context), anchor, randomness, proposal rule."""

    slot: int
    length: int
    anchor: int
    gen: torch.Generator  # CPU: proposal samples (and on a CPU drafter the noise too)
    temperature: float
    top_m: int
    noise_gen: torch.Generator | None = None  # on the drafter's device when it is not the CPU


def departures_as_trained(cfg) -> dict:
    """FlashMapProposer's options that draft as a checkpoint was trained, where its training
    departed from the paper (DrafterConfig): its noise (shared_noise), T = 0 rows from the zero
    state if it learned that jump (null_jump_fraction), the estimate its two-jump path carried,
    and its second-jump network."""
    zero = cfg.null_jump_fraction > 0
    return dict(
        shared_noise=cfg.shared_noise,
        greedy_noise_scale=0.0 if zero else 1.0,
        greedy_estimate=cfg.two_jump_estimate if zero and cfg.null_two_jump_share > 0 else "soft",
        second_jump_net=cfg.second_jump_net and zero,
    )


class FlashMapProposer(SlotCacheProposer):
    """Sequences (slots, release, truncate, set_steps): SlotCacheProposer. Truncating leaves the
    cache rows past the new length in place: masked now, overwritten by the next extend."""

    max_blocks = 64  # independent noise draws per request for tree verification

    # Drafting passes are frozen (17 rows per block: packed GEMMs pay); extends are not.
    COMPILED = {
        "_evaluate": ("evaluate", True),
        "_evaluate_greedy": ("evaluate_greedy", True),
        "_context_kv": ("context_kv", False),
    }

    GREEDY_ESTIMATES = ESTIMATES

    def __init__(
        self,
        model: FlashMapDiT,
        n_slots: int = 64,
        max_context: int = 4096,
        device: str = "cpu",
        steps: int = DRAFT_STEPS,
        shared_noise: bool = True,
        min_confidence: float = 0.0,
        greedy_estimate: Literal["soft", "argmax"] | None = "soft",
        greedy_noise_scale: float | None = 1.0,
        second_jump_net: bool = False,
    ):
        """The defaults are the paper's inference: one noise draw shared by the block's K slots
        at every temperature, T = 0 rows drafted by the flow from its own noise, carrying the
        soft estimate between jumps, the map's own jumps. Each other value is a departure
        (`departures_as_trained` names those a checkpoint was trained for): shared_noise False
        (a draw per slot), greedy_noise_scale < 1 (T = 0 rows from scaled-down noise; 0: the zero
        state, a DFlash-like mode predictor), greedy_estimate "argmax", second_jump_net (the
        checkpoint's separate network for the second of two jumps of zero-state T = 0 rows).
        None: the paper's value."""
        c = model.cfg
        super().__init__(
            model,
            n_slots,
            max_context,
            device,
            (c.n_blocks, c.n_heads, c.head_dim),
            c.block_size,
            c.dim,
        )
        greedy_estimate = "soft" if greedy_estimate is None else greedy_estimate
        greedy_noise_scale = 1.0 if greedy_noise_scale is None else greedy_noise_scale
        if greedy_estimate not in self.GREEDY_ESTIMATES:
            raise ValueError(
                f"greedy_estimate must be one of {self.GREEDY_ESTIMATES}, got {greedy_estimate!r}"
            )
        if not 0.0 <= greedy_noise_scale <= 1.0:
            raise ValueError(f"greedy_noise_scale must be in [0, 1], got {greedy_noise_scale}")
        # Temperature-0 rows only (module docstring): the clean-block estimate between flow
        # steps ("soft": softmax of the denoiser, the flow; "argmax": its one-hot argmax) and
        # the scale of the initial noise (1: the flow's own noise).
        self.greedy_estimate = greedy_estimate
        self.greedy_noise_scale = float(greedy_noise_scale)
        # The checkpoint's second-jump network (DrafterConfig.second_jump_net) drafts the second
        # of two jumps of T = 0 rows, on the path it was trained on only: the zero state and the
        # map's own estimate between the jumps.
        self.second_jump = None
        if second_jump_net:
            if model.second_jump is None:
                raise ValueError("second_jump_net: this checkpoint has no second-jump network")
            if self.greedy_noise_scale != 0.0 or greedy_estimate != c.two_jump_estimate:
                raise ValueError(
                    "second_jump_net drafts the path it was trained on: greedy_noise_scale 0 "
                    f"and greedy_estimate {c.two_jump_estimate!r}"
                )
            self.second_jump = model.second_jump
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {min_confidence}")
        self.shared_noise = shared_noise
        # Greedy drafts stop before the first slot whose drafted token has probability below
        # this (at least one token): a shorter verify when the rest would likely be rejected.
        # Any draft length keeps the output exact; 0 = always the full block.
        self.min_confidence = min_confidence
        self.set_steps(steps)
        self.graphs = None  # FlowGraphs after enable_graphs()
        self._host_noise = (
            torch.device(self.device).type == "cpu"
        )  # else: noise from a device generator
        # The network's entry points (COMPILED); enable_compile() swaps in compiled versions.
        self._evaluate = self.model.evaluate
        self._evaluate_greedy = self.model.evaluate_greedy  # the last evaluation of a draft
        self._context_kv = self.model.context_kv
        self._grids: dict[
            int, list[float]
        ] = {}  # steps -> flow times (a pure function of the config)
        if self.cfg.kind == "flashmap":
            self.model.noise_factor()  # at start-up rather than in the first request

    @property
    def bytes_per_context_token(self) -> int:
        """Cache bytes one context position takes (K and V, all blocks)."""
        return 2 * self.cfg.n_blocks * self.cfg.dim * self.k_cache.element_size()

    # ------------------------------------------------------------------ drafting
    def propose(
        self, requests: list[ProposeRequest], draft_steps: int | None = None
    ) -> list[Draft]:
        """One block per request, in request order. draft_steps: this call's step count (None:
        self.steps); a request's own draft_steps overrides it."""
        return [blocks[0] for blocks in self.propose_blocks(requests, draft_steps, n_blocks=1)]

    def propose_blocks(
        self, requests: list[ProposeRequest], draft_steps: int | None = None, n_blocks: int = 1
    ) -> list[list[Draft]]:
        """n_blocks blocks per request from independent noise draws (block 0 = `propose`'s)."""
        default = self.steps if draft_steps is None else draft_steps
        rows: list[_Row] = []
        steps: list[int] = []  # each row's draft_steps
        for r in requests:
            if r.temperature < 0 or (r.temperature > 0 and r.top_m < 1):
                raise ValueError(f"request {r.seq_id!r}: need temperature >= 0 and top_m >= 1")
            slot, length = self.slots.lookup(r.seq_id)
            for b in range(n_blocks):
                gen = request_generator(r.seed, b)
                noise_gen = None if self._host_noise else request_generator(r.seed, b, self.device)
                rows.append(
                    _Row(slot, length, int(r.anchor), gen, r.temperature, r.top_m, noise_gen)
                )
                n = default if r.draft_steps is None else r.draft_steps
                steps.append(1 if self.cfg.kind == "dflash" else int(n))
        drafts: list[Draft | None] = [None] * len(rows)
        for n in sorted(set(steps)):  # one batched pass per distinct step count
            idx = [i for i, k in enumerate(steps) if k == n]
            group = [rows[i] for i in idx]
            for i, d in zip(idx, self._propose_rows(group, n)):
                d.draft_steps = n
                drafts[i] = d
        return [drafts[i * n_blocks : (i + 1) * n_blocks] for i in range(len(requests))]

    def cross_context(self, seq_ids: list[str]) -> CrossContext:
        """The cached context of these sequences as the model's CrossContext (unknown: empty)."""
        rows = [self.slots.lookup(s) for s in seq_ids]
        return self._context([slot for slot, _ in rows], [length for _, length in rows])

    def _context(self, slots: list[int], lengths: list[int]) -> CrossContext:
        """Cache rows as a CrossContext, cut to the longest row (slot -1: no context)."""
        lengths_t = torch.tensor(lengths, device=self.device)
        if len(slots) == 1:  # one row: views of the cache, no gather copy
            s, w = max(slots[0], 0), max(lengths + [1])
            return CrossContext(
                [
                    (self.k_cache[i, s : s + 1, :, :w], self.v_cache[i, s : s + 1, :, :w])
                    for i in range(self.cfg.n_blocks)
                ],
                lengths_t,
            )
        slots_t = torch.tensor([max(i, 0) for i in slots], device=self.device)
        return self._context_tensors(slots_t, lengths_t, max(lengths + [1]))

    def _context_tensors(self, slots: Tensor, lengths: Tensor, window: int) -> CrossContext:
        """The first `window` cache positions of rows `slots` [B] (device tensors: no host sync,
        so CUDA graphs can capture it)."""
        kv = [
            (
                self.k_cache[i, :, :, :window].index_select(0, slots),
                self.v_cache[i, :, :, :window].index_select(0, slots),
            )
            for i in range(self.cfg.n_blocks)
        ]  # [B, h, window, d] each
        return CrossContext(kv, lengths)

    @property
    def available_steps(self) -> tuple[int, ...] | None:
        return tuple(self.graphs.steps) if self.graphs is not None else None

    def enable_graphs(self, steps: tuple[int, ...] = (1, 2), mode: str = "cuda", **buckets) -> dict:
        """Capture the flow integration per (steps, batch bucket, context bucket); see cuda_graphs."""
        from drafter_service.cuda_graphs import FlowGraphs

        if self.cfg.kind != "flashmap":
            return {
                "graphs": 0,
                "reason": "a DFlash-style drafter has one pass and no flow to capture",
            }
        self.graphs = FlowGraphs(self, steps, mode=mode, **buckets)
        return self.graphs.capture()

    def _network(
        self,
        y: Tensor | None,
        s: Tensor | float,
        t: Tensor | float,
        anchor: Tensor,
        ctx: CrossContext,
        greedy: bool = False,
    ):
        """The model at the embedded state y [B, K, H] through the (possibly compiled) evaluation:
        logits [B, K, V], or with greedy=True (logits, ids, prob) (FlashMapDiT.evaluate_greedy).
        Times are host floats, or device tensors inside CUDA graphs (never compiled together)."""
        f = self._evaluate_greedy if greedy else self._evaluate
        return f(y, self.model.modulations(s, t, anchor.shape[0]), anchor, ctx.kv, ctx.lengths)

    @torch.inference_mode()
    def _propose_rows(self, rows: list[_Row], steps: int) -> list[Draft]:
        K = self.block_size
        anchor = torch.tensor([r.anchor for r in rows], device=self.device)  # [B]
        if self.cfg.kind == "dflash":
            ctx = self._context([r.slot for r in rows], [r.length for r in rows])
            logits, *summary = self._network(None, 0.0, 1.0, anchor, ctx, greedy=True)  # [B, K, V]
        else:
            # z is drawn on the drafter's device (CPU: from the request's one generator);
            # shared noise is one [r] row per request, expanded over the K slots.
            F = self.model.noise_factor()  # [r, H]
            noise = [
                draw_noise(r.noise_gen or r.gen, K, F.shape[0], self.shared_noise) for r in rows
            ]
            if self.shared_noise:
                z = torch.stack([n[0] for n in noise]).to(self.device, F.dtype)  # [B, r]
                y = (z @ F)[:, None].expand(-1, K, -1)  # [B, K, H]
            else:
                y = torch.stack(noise).to(self.device, F.dtype) @ F  # [B, K, H]
            greedy = torch.tensor([r.temperature == 0 for r in rows], device=self.device)  # [B]
            any_greedy = any(r.temperature == 0 for r in rows)  # on the host: no device read
            if self.greedy_noise_scale != 1.0 and any_greedy:
                scale = torch.where(greedy, self.greedy_noise_scale, 1.0).to(y.dtype)
                y = y * scale[:, None, None]
            hard = greedy if self.greedy_estimate == "argmax" and any_greedy and steps > 1 else None
            second = greedy if self.second_jump is not None and any_greedy and steps == 2 else None
            logits, summary = None, None
            if self.graphs is not None and second is None:  # graphs hold the map's jumps only
                logits = self.graphs.run(
                    y, anchor, [r.slot for r in rows], [r.length for r in rows], steps, hard
                )
            if logits is None:
                ctx = self._context([r.slot for r in rows], [r.length for r in rows])
                every = second is not None and all(r.temperature == 0 for r in rows)
                logits, *summary = self._integrate(
                    y, anchor, ctx, steps, summary=True, hard=hard, second=second, every=every
                )
        return self._sample(logits, rows, summary)

    def _integrate(
        self,
        y: Tensor,
        anchor: Tensor,
        ctx: CrossContext,
        steps: int,
        times: list[Tensor] | None = None,
        summary: bool = False,
        hard: Tensor | None = None,
        second: Tensor | None = None,
        every: bool = False,
    ):
        """Run the flow from the embedded noise y_0 [B, K, H] to t = 1; returns the last
        evaluation's logits [B, K, V] (summary=True: (logits, ids, prob), `greedy_summary`).
        times: the grid as [B] device tensors (CUDA graphs); default: host floats.
        hard [B] bool: rows whose clean-block estimate between steps is the one-hot argmax of
        the denoiser instead of its softmax (mode-seeking greedy drafting).
        second [B] bool (two jumps): rows whose second jump is the second-jump network's;
        every: all of them (a host bool: no device read)."""
        if steps not in self._grids:
            self._grids[steps] = [
                float(g) for g in self.model.time_grid(steps)
            ]  # the drafter's own time map
        grid = self._grids[steps]
        tt = grid if times is None else times
        euler = steps >= 3  # 1-2 steps: flow-map jumps (s, t); more: teacher ODE (t, t)
        out = None
        for i in range(len(grid) - 1):
            a, b = tt[i], tt[i + 1]
            last = i == len(grid) - 2
            if last and second is not None:
                out = self._second_jump(y, a, b, anchor, ctx, second, every, greedy=summary)
            else:
                out = self._network(y, a, a if euler else b, anchor, ctx, greedy=summary and last)
            if not last:  # the last update would give x_1 = pi: the logits already say it
                E = self.model.embed
                clean = out.softmax(-1).to(E.dtype) @ E  # [B, K, H]: pi @ E
                if hard is not None:  # one-hot argmax: the row of E of each slot's argmax
                    clean = torch.where(hard[:, None, None], E[out.argmax(-1)], clean)
                y = jump(y, clean, a, b)  # y_b = X_{a,b}(x_a) @ E
        return out

    def _second_jump(
        self,
        y: Tensor,
        s: float,
        t: float,
        anchor: Tensor,
        ctx: CrossContext,
        rows: Tensor,
        every: bool,
        greedy: bool,
    ):
        """The last of two jumps: the second-jump network's pass (conditioned on (0, 1), as
        trained) for the rows [B] bool, the map's jump s -> t for the others (computed only when
        there are others: not `every`); outputs as `_network`'s."""
        net = self.second_jump
        f = net.evaluate_greedy if greedy else net.evaluate
        out = f(y, net.modulations(0.0, 1.0, anchor.shape[0]), anchor, ctx.kv, ctx.lengths)
        if every:
            return out
        mine = self._network(y, s, t, anchor, ctx, greedy=greedy)
        pick = lambda a, b: torch.where(rows.view(-1, *[1] * (a.dim() - 1)), a, b)  # noqa: E731
        return tuple(map(pick, out, mine)) if greedy else pick(out, mine)

    def _sample(
        self, logits: Tensor, rows: list[_Row], summary: list[Tensor] | None = None
    ) -> list[Draft]:
        """Greedy rows: per-slot argmax. Sampling rows: top-m of softmax(logits / T), renormalised.
        summary: the logits' (ids, prob) when the last evaluation made them (`greedy_summary`)."""
        ids, prob = summary if summary else greedy_summary(logits)  # [B, K] each
        greedy = ids.cpu().numpy()
        keep = np.full(len(rows), self.block_size)
        if self.min_confidence > 0:
            low = (prob < self.min_confidence).cpu().numpy()  # [B, K]
            keep = np.where(low.any(1), np.maximum(low.argmax(1), 1), self.block_size)
        if all(r.temperature == 0 for r in rows):
            return [Draft.greedy(g[:n]) for g, n in zip(greedy, keep)]
        m_max = max([r.top_m for r in rows if r.temperature > 0] + [1])
        top_logits, top_ids = logits.topk(min(m_max, self.vocab_size), dim=-1)  # [B, K, m_max]
        top_logits, top_ids = top_logits.cpu(), top_ids.cpu()
        out = []
        for i, r in enumerate(rows):
            if r.temperature == 0:
                out.append(Draft.greedy(greedy[i][: keep[i]]))
                continue
            m = min(r.top_m, self.vocab_size)
            q = (top_logits[i, :, :m].double() / r.temperature).softmax(
                -1
            )  # [K, m]; topk order = q order
            pick = torch.multinomial(q, 1, generator=r.gen)[:, 0]  # [K]
            ids = top_ids[i, :, :m]
            tokens = ids.gather(1, pick[:, None])[:, 0]
            out.append(
                Draft(
                    tokens.numpy().astype(np.int64), ids.numpy().astype(np.int64), q.float().numpy()
                )
            )
        return out
