"""The published drafters' rows of bench.gpu_e2e: DFlash in z-lab's layout (layers at the target's
width, a block of 16 positions: the anchor and 15 drafts) and EAGLE-3 in SafeAILab's (one layer,
a draft vocabulary, at T = 0 a tree of 16 drafts that the target verifies row by row), with
random weights over the target's frozen tensors and their CUDA graphs per (batch, context)
bucket, decoded through the same loop as the other rows and set against a verify of 17 plus
the drafter's captured pass, each replayed alone.

EAGLE-3 reads three layers' features where the other drafters read five, so its rows run on an
engine of their own over the same model (its KV cache replaces the first engine's): they come
last.
"""

from __future__ import annotations

import time

import torch

from bench.gpu_timing import say, timed

# Sizes of the GPU run (Qwen3-8B's published drafters) and of the CPU smoke run.
SHAPES = {
    "gpu": dict(dflash_layers=5, eagle3_draft_vocab=32_000),
    "smoke": dict(dflash_layers=1, eagle3_draft_vocab=300),
}
LABELS = {"dflash": "DFlash (published layout)", "eagle3": "EAGLE-3 (tree of 16)"}


def _randomize(model: torch.nn.Module, dev, seed: int) -> None:
    """N(0, 0.02) matrices, as the published trainers initialise them; norms stay at 1."""
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.02, generator=g)


def build_dflash(target, feature_layers, n_layers: int, dev, dtype, seed: int = 0):
    """A DFlash drafter of the published layout over the target model's embedding / LM head
    (shared, not copied)."""
    from drafter_service.dflash import DFlashDrafter
    from drafter_service.dflash_config import DFlashConfig
    from flashmap.rope_config import RopeParameters

    c = target.config
    cfg = DFlashConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=n_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        vocab_size=c.vocab_size,
        target_layer_ids=tuple(feature_layers),
        mask_token_id=c.vocab_size - 1,
        block_size=16,
        rms_norm_eps=c.rms_norm_eps,
        rope=RopeParameters.default(c.rope_theta),
    )
    embed, lm_head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    with torch.device(dev):
        model = DFlashDrafter(cfg, embed, lm_head)
    _randomize(model, dev, seed)
    return model.to(dtype).eval()


def build_eagle3(target, aux_layers, draft_vocab: int, dev, dtype, seed: int = 0):
    """An EAGLE-3 drafter of the published layout over the target model's embedding; its draft
    vocabulary: the first `draft_vocab` ids."""
    from drafter_service.eagle3 import Eagle3Config, Eagle3Drafter, draft_vocabulary
    from flashmap.rope_config import RopeParameters

    c = target.config
    cfg = Eagle3Config(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        vocab_size=c.vocab_size,
        draft_vocab_size=draft_vocab,
        target_hidden_size=c.hidden_size,
        aux_layer_ids=tuple(aux_layers),
        rms_norm_eps=c.rms_norm_eps,
        rope=RopeParameters.default(c.rope_theta),
    )
    with torch.device(dev):
        model = Eagle3Drafter(cfg)
    model.layer_ids = tuple(aux_layers)
    _randomize(model, dev, seed)
    d2t, t2d = draft_vocabulary(torch.arange(c.vocab_size, 0, -1).float(), draft_vocab)
    model.d2t, model.t2d = d2t.to(dev), t2d.to(dev)
    model = model.to(dtype)
    model.set_embedding(target.model.embed_tokens.weight)
    return model.eval()


def bucket_kernel_ms(prop, b: int, at: int, dev, reps: int) -> float:
    """A published drafter's captured pass (cuda_graphs.BucketGraphs) for b rows with `at`
    context positions, alone: CUDA events on its replay; without a graph (static mode, CPU)
    the padded pass on the host clock."""
    from drafter_service.cuda_graphs import bucket_of

    g = prop.graphs
    key = (bucket_of(b, g.batch_buckets), bucket_of(at, g.context_buckets))
    if key not in g.graphs:
        raise RuntimeError(f"no drafter graph for {b} rows at context {at}")
    anchor = torch.zeros(b, dtype=torch.long, device=dev)
    slots, lengths = torch.arange(b, device=dev), torch.full((b,), at, device=dev)
    run = lambda: g.run(anchor, slots, lengths, at)  # noqa: E731
    graph = g.graphs[key][2]
    run()
    if graph is not None:
        return timed(graph.replay, dev, reps)["device_ms"]
    return timed(run, dev, reps)["ms"]


def published_rows(run, kind: str) -> None:
    """A published drafter's rows (kind "dflash" or "eagle3"), one per batch: DFlash over the
    run's engine and its bucketed graphs, EAGLE-3 over an engine of its own."""
    if kind in run.skip:
        return
    shape = SHAPES["smoke" if run.a.smoke else "gpu"]
    eng = run.engine
    if kind == "dflash":
        layers, n = eng.feature_layers, shape["dflash_layers"]
        build = lambda dev, dtype: build_dflash(run.model, layers, n, dev, dtype)  # noqa: E731
    else:
        from flashmap.drafter_inputs import eagle3_default_layers
        from target_service.engine import TargetEngine

        if not run.guard.fits(run.need("eagle3", run.batches[0]) + run.need("drafter", 0)):
            return say(f"eagle3 rows: skipped (time guard, {run.guard.left():.0f} s left)")
        layers, vd = (
            eagle3_default_layers(run.model.config.num_hidden_layers),
            shape["eagle3_draft_vocab"],
        )
        try:
            eng = run.engine = TargetEngine.from_model(  # the rows' loops and kernels run on it
                run.model,
                n_slots=eng.n_slots,
                max_seq_len=eng.max_seq_len,
                feature_layers=layers,
                eos_token_ids=[],
            )
            run.report["capture"]["target for eagle3"] = eng.enable_graphs(mode=run.mode)
        except Exception as e:  # noqa: BLE001
            run.failed("eagle3 engine", e)
            return
        build = lambda dev, dtype: build_eagle3(run.model, layers, vd, dev, dtype)  # noqa: E731
    _rows(run, kind, eng, build)


def _rows(run, kind: str, eng, build) -> None:
    """One published drafter's rows over `eng`: built, its graphs captured, a row per batch."""
    from drafter_service.factory import make_proposer

    dev, t = run.dev, time.perf_counter()
    if not run.guard.fits(run.need(kind, run.batches[0]) + run.need("drafter", 0)):
        return say(f"{kind} rows: skipped (time guard, {run.guard.left():.0f} s left)")
    try:
        model = build(dev, run.dtype)
        prop = make_proposer(
            model, device=str(dev), n_slots=max(run.batches), max_context=eng.max_seq_len
        )
        run.report.setdefault("published", {})[kind] = dict(
            params=sum(p.numel() for p in model.parameters()),
            drafts_per_block=prop.block_size,
            build_s=round(time.perf_counter() - t, 2),
        )
        run.report["capture"][kind] = prop.enable_graphs(mode=run.mode)
    except Exception as e:  # noqa: BLE001
        run.failed(kind, e)
        return
    say(f"{kind}: {run.report['published'][kind]} graphs {run.report['capture'][kind]}")
    for b in run.batches:

        def fn(b=b):
            kernels = lambda: {  # noqa: E731
                "verify17": run.verify_kernel_ms(eng, b),
                "drafter": bucket_kernel_ms(prop, b, run.at, dev, run.reps),
            }
            r, toks = run.measure(kind, b, prop, None, kernels)
            alone = run.alone.get(b)
            if alone is not None:
                r["outputs_equal_target"] = [sum(x == y for x, y in zip(toks, alone)), len(toks)]
            return r

        run.row(kind, b, 0, fn)
    prop = model = None  # freed before the next rows
