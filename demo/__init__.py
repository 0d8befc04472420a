"""The demo's own model and data: a small Qwen3 target trained from scratch on CPU on a local
corpus, and the prompts its drafters are trained and evaluated on. Nothing is downloaded.

- ``corpus`` assembles ``corpus_code`` (Python standard library sources), ``corpus_math``
  (generated problems with worked solutions) and ``corpus_chat`` (dialogues rendered with the
  chat template), each split into training and held-out documents and prompts;
- ``tokenizer``: a byte-level BPE with the Qwen special tokens and a Qwen-style chat template;
- ``train_target`` trains the target (``target_model``: the model, its optimizer and loss) on
  ``target_data`` (token streams and windows) and writes the checkpoint
  (``target_checkpoint``) with what ``target_card`` makes beside the weights (samples, loss
  curves, model card);
- ``drafter_prompts``: the drafters' training prompts, prefixes of the corpus' training split;
- ``data/``: the held-out prompts, split into ``dev_prompts.jsonl`` (what choices read) and
  ``test_prompts.jsonl`` (what ``flashmap eval`` and the benchmarks read by default), and the
  drafters' training prompts (``drafter_prompts.jsonl``).

``run_demo_pipeline.sh`` runs the demo chain: target, prompts, data (``training.drafter_data``),
the drafters (``training``), ``flashmap eval``.
"""
