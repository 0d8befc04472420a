"""What `flashmap eval` compares: the methods (a drafter checkpoint, how many flow-map jumps,
which noise, tree or cut drafts) built from its options, the target layers each reads, and a
proposer for each."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from flashmap.checkpoint import read_config
from flashmap.drafts import TOP_M

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
    # The proposer's departures from the paper's inference (FlashMapProposer: shared_noise,
    # greedy_noise_scale, greedy_estimate, second_jump_net; Eagle3Proposer: sampled_tree);
    # empty: none.
    departures: dict = field(default_factory=dict)
    # > 1: that many blocks from independent noise verified as one tree (flashmap.rounds)
    tree_blocks: int = 1
    tree_sampling: str = "pick"  # how a tree at T > 0 is verified (flashmap.rounds.merged_draft)
    # > 0: greedy drafts cut before the first less sure slot (T = 0 only)
    min_confidence: float = 0.0
    only_t: float | None = None  # the one temperature this row runs at (None: every one)
    top_m: int = TOP_M  # the drafter's support per slot at T > 0 (other than TOP_M: T > 0 only)
    sibling_depth: int = 0  # siblings beside the first N depths only (0: every depth)

    @property
    def tree_width(self) -> int:
        """The most drafted tokens per block the method verifies: the block, or with siblings the
        block's whole top-m support."""
        return self.tree_blocks * (self.top_m if self.tree_sampling == "siblings" else 1)

    def runs_at(self, temperature: float) -> bool:
        if self.only_t is not None and temperature != self.only_t:
            return False
        if self.top_m != TOP_M and temperature == 0:
            return False
        return self.min_confidence == 0 or temperature == 0

    @property
    def shared_noise(self) -> bool:
        return self.departures.get("shared_noise", True)


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
            Method("flashmap-1", "FlashMap, 1 jump", args.flashmap, "flashmap", 1),
            Method("flashmap-2", "FlashMap, 2 jumps", args.flashmap, "flashmap", 2),
        ]
        trained = departures_of(args.flashmap)
        if trained:
            what = ", ".join(f"{k}={v}" for k, v in trained.items())
            for n in (1, 2):
                methods.append(
                    Method(
                        f"flashmap-trained-{n}",
                        f"FlashMap, {n} jump{'s' * (n > 1)}, as trained (departures: {what})",
                        args.flashmap,
                        "flashmap",
                        n,
                        departures=trained,
                    )
                )
            # Each departure alone, where it stands alone (the estimate and the second-jump
            # network act only on zero-state rows).
            alone = [k for k in trained if k in ("shared_noise", "greedy_noise_scale")]
            for k in alone if len(trained) > 1 else []:
                methods.append(
                    Method(
                        f"flashmap-{k.replace('_', '-')}-1",
                        f"FlashMap, 1 jump, one departure: {k}={trained[k]}",
                        args.flashmap,
                        "flashmap",
                        1,
                        departures={k: trained[k]},
                    )
                )
        methods += tree_methods("flashmap", "FlashMap, 1 jump", args.flashmap, args.tree_blocks)
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
        methods += tree_methods("dflash", "DFlash-style", args.dflash, args.tree_blocks)
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
    if getattr(args, "dflash_sampling", None):
        kind_of(args.dflash_sampling, "dflash", "--dflash-sampling")
        label = "DFlash-style, trained on sampled answers"
        methods.append(Method("dflash-t1", label, args.dflash_sampling, "dflash", 1))
        methods += tree_methods(
            "dflash", label, args.dflash_sampling, args.tree_blocks, name="dflash-t1"
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
        methods.append(siblings_method("eagle", "EAGLE-style chain", args.eagle))
    else:
        notes.append("no --eagle checkpoint: EAGLE rows skipped")
    methods += published_methods(args)
    if not args.no_shuffle:
        by_name = {m.name: m for m in methods}
        for indep, base in SHUFFLE.items():
            if base in by_name:
                b = by_name[base]
                methods.append(
                    Method(
                        indep,
                        f"{b.label}, independent noise per slot",
                        b.checkpoint,
                        b.kind,
                        b.steps,
                        departures={"shared_noise": False},
                    )
                )
    if not methods:
        raise ValueError(
            "give at least one drafter checkpoint (--flashmap, --teacher, --dflash, --eagle)"
        )
    for d in [x for x in getattr(args, "sibling_depth", []) if x > 0]:
        methods += [
            replace(b, name=f"{b.name}-d{d}", label=f"{b.label} at depths <= {d}", sibling_depth=d)
            for b in methods
            if b.tree_sampling == "siblings" and b.sibling_depth == 0
        ]
    for m in [x for x in getattr(args, "top_m", []) if x != TOP_M]:
        methods += [
            replace(b, name=f"{b.name}-m{m}", label=f"{b.label}, top-{m} support", top_m=m)
            for b in methods
            if b.top_m == TOP_M and (b.name in SUPPORT_ROWS or b.tree_sampling == "siblings")
        ]
    return methods, notes


# The rows `--top-m` repeats with another support size (T > 0): each drafter's single draft, and
# (by their rule) its blocks with siblings.
SUPPORT_ROWS = ("flashmap-1", "dflash", "dflash-t1", "eagle", "eagle3-chain16")


def tree_methods(
    kind: str, label: str, checkpoint: str, sizes: list[int], name: str = ""
) -> list[Method]:
    """Rows of `sizes` blocks from independent noise verified as one tree: at T = 0 the merged
    tree the target follows; at T > 0 that ("pick") and each block a chain with its proposal
    law ("rejection", multi-draft rejection sampling). With any size, at T > 0 the one block
    with each drafted token's other support tokens beside it ("siblings")."""
    name = name or kind  # the rows' prefix
    out = [siblings_method(kind, label, checkpoint, name=name)] if sizes else []
    for n in sizes:
        if n < 2:
            continue
        out.append(
            Method(
                f"{name}-tree{n}",
                f"{label}, tree of {n} blocks",
                checkpoint,
                kind,
                1,
                tree_blocks=n,
            )
        )
        out.append(
            Method(
                f"{name}-tree{n}-rejection",
                f"{label}, {n} blocks, multi-draft rejection sampling (T > 0)",
                checkpoint,
                kind,
                1,
                tree_blocks=n,
                tree_sampling="rejection",
                only_t=1.0,
            )
        )
    return out


def siblings_method(kind: str, label: str, checkpoint: str, name: str = "", **departures) -> Method:
    """The drafter's one block at T > 0 with each drafted token's other top-m tokens beside it
    as leaves, verified by multi-draft rejection sampling (flashmap.drafts.Draft.with_siblings)."""
    return Method(
        f"{name or kind}-siblings",
        f"{label}, one block with its top-m siblings (T > 0)",
        checkpoint,
        kind,
        1,
        departures=departures,
        tree_sampling="siblings",
        only_t=1.0,
    )


def departures_of(checkpoint: str) -> dict:
    """The proposer options that draft as a FlashMap checkpoint was trained, where they depart
    from the paper's inference (drafter_service.flashmap_proposer.departures_as_trained)."""
    from drafter_service.config import DrafterConfig
    from drafter_service.flashmap_proposer import departures_as_trained

    cfg = DrafterConfig(
        **{
            k: v
            for k, v in read_config(checkpoint).items()
            if k in DrafterConfig.__dataclass_fields__
        }
    )
    paper = {
        "shared_noise": True,
        "greedy_noise_scale": 1.0,
        "greedy_estimate": "soft",
        "second_jump_net": False,
    }
    return {k: v for k, v in departures_as_trained(cfg).items() if v != paper[k]}


def published_methods(args) -> list[Method]:
    """The published layouts' rows: DFlash (z-lab) and EAGLE-3 (its dynamic tree of 16 at every
    temperature, and at T > 0 its chain of 16 beside it, alone and with its top-m siblings:
    drafter_service.eagle3_proposer)."""
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
            Method("eagle3-tree16", "EAGLE-3, tree of 16", "", "eagle3"),
        ),
    ):
        if path:
            if not test(read_config(path)):
                raise ValueError(f"{flag} {path}: not a checkpoint in that published layout")
            method.checkpoint = path
            out.append(method)
            if method.kind == "eagle3":
                out.append(
                    Method(
                        "eagle3-chain16",
                        "EAGLE-3, chain of 16 (T > 0)",
                        path,
                        "eagle3",
                        departures={"sampled_tree": False},
                        only_t=1.0,
                    )
                )
                out.append(
                    siblings_method("eagle3", "EAGLE-3, chain of 16", path, sampled_tree=False)
                )
    return out


def feature_layers_of(m: Method, target: str) -> tuple[int, ...]:
    """The target layers the method's drafter reads (its engine computes those)."""
    from flashmap.drafter_inputs import drafter_inputs

    n = int(read_config(target)["num_hidden_layers"])
    return tuple(drafter_inputs(m.checkpoint, n).feature_layers)


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
        compile=compile,
        **m.departures,
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
