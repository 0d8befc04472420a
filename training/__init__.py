"""Training a drafter for a target: what a user runs, from a Hugging Face Qwen3 directory and a
prompt file to a served drafter, and `flashmap eval`. Everything runs from local files only (no
model or data hub).

Data:
- ``generate_data``: token data (prompts -> the target's own responses, ids only), under
  torchrun sharded over ranks; ``online_features``: the target inside training, each batch's
  features computed by the serving engine;
- ``drafter_data``: the same shards with the target's features stored (offline).

Drafters:
- ``flow``: blocks, noisy states, flow times and the losses of the flow, distillation and
  DFlash-style stages; ``trainer``: the loop every drafter trainer shares, over
  ``sequence_stream`` (the data stream), with ``train_options`` (the config's JSON form and the
  shared command-line options) and ``loss_plot``; ``step_batches``: a step's blocks across ranks
  and micro-batches; ``distributed``: torchrun, DDP / FSDP2;
- ``train_drafter`` (FlashMap flow stage and flow-map distillation, DFlash-style; its settings
  in ``train_drafter_config``), with ``warm_start`` (a flow stage started from a DFlash-style drafter); ``train_eagle``
  (EAGLE-style chain); ``train_published`` (DFlash and EAGLE-3 in their published layouts);
- ``export_drafter``: a run as a small servable checkpoint.

Checks:
- ``acceptance_check``: held-out acceptance every N steps of a run, over ``heldout`` (held-out
  anchors) and ``offline_acceptance`` (drafts verified by the target);
- ``denoiser_curve``: is a FlashMap drafter a flow (the flow stage's gate at every save);
  ``shuffle_test``: the acceptance a block owes to the joint structure of one draw;
  ``flow_diagnostics``: these as one command;
- ``smoke_check``: the two ends of scripts/train-smoke.sh.

``evaluate`` is ``flashmap eval`` (acceptance length and speedup of drafters on held-out
prompts), over ``eval_prompts``, ``eval_methods``, ``eval_cells`` and ``eval_report``.

The demo's own target, tokenizer, corpus and prompts are the package ``demo``; research
probes and studies are ``research``, which nothing here imports.
"""
