"""What `flashmap eval` compares: the methods (a drafter checkpoint, how many flow-map jumps,
which noise, tree or cut drafts) built from its options, the target layers each reads, and a
proposer for each."""

from __future__ import annotations

from dataclasses import dataclass

from flashmap.checkpoint import read_config

# (method, base method of the shuffle pair)
SHUFFLE = {
    "flashmap-1-indep": "flashmap-1",
    "flashmap-2-indep": "flashmap-2",
    "dflash-indep": "dflash",
}


@dataclass
class Method:
    name: str
    label: str
    checkpoint: str
    kind: str  # flashmap | dflash | eagle | dflash-published | eagle3
    steps: int = 1
    # None: the noise the drafter was trained on (its config); False: a draw per slot
    shared_noise: bool | None = None
    # > 1: that many blocks from independent noise verified as a tree (T = 0 only)
    tree_blocks: int = 1
    # > 0: greedy drafts cut before the first less sure slot (T = 0 only)
    min_confidence: float = 0.0

    def runs_at(self, temperature: float) -> bool:
        return (self.tree_blocks == 1 and self.min_confidence == 0) or temperature == 0


def build_methods(args) -> tuple[list[Method], list[str]]:
    from drafter_service.checkpoint import checkpoint_kind

    methods, notes = [], []

    def kind_of(path: str, want: str, flag: str) -> str:
        k = checkpoint_kind(path)
        if k != want:
            raise ValueError(f"{flag} {path}: a {k!r} drafter, expected {want!r}")
        return k

    if args.flashmap:
        kind_of(args.flashmap, "flashmap", "--flashmap")
        methods += [
            Method("flashmap-1", "FlashMap, 1 step", args.flashmap, "flashmap", 1),
            Method("flashmap-2", "FlashMap, 2 steps", args.flashmap, "flashmap", 2),
        ]
        if args.tree_blocks > 1:
            methods.append(
                Method(
                    "flashmap-1-tree",
                    f"FlashMap, 1 step, tree of {args.tree_blocks} blocks (T = 0)",
                    args.flashmap,
                    "flashmap",
                    1,
                    tree_blocks=args.tree_blocks,
                )
            )
    if args.teacher or args.flashmap:
        src = args.teacher or args.flashmap
        kind_of(src, "flashmap", "--teacher" if args.teacher else "--flashmap")
        if not args.teacher:
            notes.append(
                "no --teacher: the teacher-flow rows integrate the distilled model's diagonal (s = t)"
            )
        methods.append(
            Method(
                f"flow-{args.teacher_steps}",
                f"teacher flow, {args.teacher_steps} Euler steps",
                src,
                "flashmap",
                args.teacher_steps,
            )
        )
    else:
        notes.append("no --flashmap / --teacher checkpoint: FlashMap rows skipped")
    if args.dflash:
        kind_of(args.dflash, "dflash", "--dflash")
        methods.append(Method("dflash", "DFlash-style", args.dflash, "dflash", 1))
    else:
        notes.append("no --dflash checkpoint: DFlash rows skipped")
    # The draft cut of FlashMapProposer(min_confidence=...), greedy rows only.
    if args.min_confidence > 0:
        for base in [m for m in methods if m.name in ("flashmap-1", "dflash")]:
            methods.append(
                Method(
                    f"{base.name}-cut",
                    f"{base.label}, drafts cut below {args.min_confidence:g} (T = 0)",
                    base.checkpoint,
                    base.kind,
                    base.steps,
                    min_confidence=args.min_confidence,
                )
            )
    if args.dflash_start:
        kind_of(args.dflash_start, "dflash", "--dflash-start")
        methods.append(
            Method(
                "dflash-start",
                "DFlash-style, FlashMap's warm start",
                args.dflash_start,
                "dflash",
                1,
            )
        )
    if args.eagle:
        kind_of(args.eagle, "eagle", "--eagle")
        methods.append(Method("eagle", "EAGLE-style chain", args.eagle, "eagle", 1))
    else:
        notes.append("no --eagle checkpoint: EAGLE rows skipped")
    methods += published_methods(args)
    if not args.no_shuffle:
        by_name = {m.name: m for m in methods}
        for indep, base in SHUFFLE.items():
            if base in by_name:
                b = by_name[base]
                if b.kind == "flashmap" and not _trained_shared(b.checkpoint):
                    # Its own draws are per slot already: the pair would be the same run twice.
                    notes.append(
                        f"{b.label}: no per-slot shuffle row, its noise is a draw per slot already "
                        "(config shared_noise = false); its joint structure is the permutation-shuffle "
                        "Delta of `python -m training.flow_diagnostics` (K shared-noise runs, slot k "
                        "from run k)"
                    )
                    continue
                methods.append(
                    Method(
                        indep,
                        f"{b.label}, independent noise per slot",
                        b.checkpoint,
                        b.kind,
                        b.steps,
                        shared_noise=False,
                    )
                )
    if not methods:
        raise ValueError(
            "give at least one drafter checkpoint (--flashmap, --teacher, --dflash, --eagle)"
        )
    return methods, notes


def published_methods(args) -> list[Method]:
    """The published layouts' rows: DFlash (z-lab) and EAGLE-3 (a tree of 16 at T = 0, a chain
    of 16 when sampling: drafter_service.eagle3_proposer)."""
    from drafter_service.dflash_config import is_dflash
    from drafter_service.eagle3 import is_eagle3

    out = []
    for path, test, flag, method in (
        (
            getattr(args, "dflash_published", None),
            is_dflash,
            "--dflash-published",
            Method("dflash-published", "DFlash (published architecture)", "", "dflash-published"),
        ),
        (
            getattr(args, "eagle3", None),
            is_eagle3,
            "--eagle3",
            Method(
                "eagle3-tree16", "EAGLE-3, tree of 16 (T = 0; chain of 16 at T > 0)", "", "eagle3"
            ),
        ),
    ):
        if path:
            if not test(read_config(path)):
                raise ValueError(f"{flag} {path}: not a checkpoint in that published layout")
            method.checkpoint = path
            out.append(method)
    return out


def feature_layers_of(m: Method, target: str) -> tuple[int, ...]:
    """The target layers the method's drafter reads (its engine computes those)."""
    from flashmap.drafter_inputs import drafter_inputs

    n = int(read_config(target)["num_hidden_layers"])
    return tuple(drafter_inputs(m.checkpoint, n).feature_layers)


def _trained_shared(checkpoint: str) -> bool:
    """Whether a FlashMap checkpoint was trained (and drafts) with one noise draw shared by its K slots."""
    return bool(read_config(checkpoint).get("shared_noise", False))


def make_proposer(m: Method, target: str, engine, device: str, cache: dict, compile: bool = False):
    """A fresh proposer for the method (the loaded model is shared between methods, and so are
    its compilations: SlotCacheProposer.enable_compile)."""
    from drafter_service import factory

    if m.checkpoint not in cache:
        cache[m.checkpoint] = factory.load_model(m.checkpoint, target, device=device)
    return factory.make_proposer(
        cache[m.checkpoint],
        device=device,
        n_slots=1,
        max_context=engine.max_seq_len,
        steps=m.steps,
        min_confidence=m.min_confidence,
        shared_noise=m.shared_noise,
        compile=compile,
    )


def params_of(model) -> int:
    return sum(p.numel() for p in model.parameters())


def describe(m: Method, model, target: str) -> str:
    """The method's drafter in one line: kind, architecture, parameters, target layers."""
    from drafter_service.checkpoint import checkpoint_kind

    c, n = model.cfg, f"{params_of(model) / 1e6:.2f}M trainable parameters"
    layers = list(feature_layers_of(m, target))
    if m.kind == "dflash-published":
        return (
            f"DFlash as published (DFlashDraftModel), {c.num_hidden_layers} layers, width "
            f"{c.hidden_size}, intermediate {c.intermediate_size}, {c.num_attention_heads} heads, "
            f"block {c.block_size} (anchor + {c.block_size - 1} drafts), {n}, target layers {layers}"
        )
    if m.kind == "eagle3":
        return (
            f"EAGLE-3 as published (LlamaForCausalLMEagle3), 1 layer, width {c.hidden_size}, "
            f"intermediate {c.intermediate_size}, {c.num_attention_heads} heads, draft vocabulary "
            f"{c.draft_vocab_size} of {c.vocab_size}, {n}, target layers {layers}"
        )
    arch = f"{c.n_layers} layer(s)" if m.kind == "eagle" else f"{c.n_blocks} blocks"
    return (
        f"kind {checkpoint_kind(m.checkpoint)}, {arch}, width {c.dim}, {c.n_heads} heads, {n}, "
        f"feature layers {list(c.feature_layers)}"
    )
