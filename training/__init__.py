"""Training: the demo target, the drafters' data and the drafters, their diagnostics, and
`flashmap eval`. Everything runs from local text only (no model or data hub).

The demo target (a standard Hugging Face Qwen3 checkpoint):
- ``corpus`` assembles ``corpus_code`` (Python standard library sources), ``corpus_math``
  (generated problems with worked solutions) and ``corpus_chat`` (dialogues rendered with
  the chat template), each split into training and held-out documents and prompts;
- ``tokenizer``: a byte-level BPE with the Qwen special tokens and a Qwen-style chat template;
- ``train_target`` trains it on ``target_data`` (token streams and windows) and writes what
  ``target_card`` makes beside the weights (samples, loss curves, model card).

Drafters:
- ``drafter_prompts``, ``drafter_data``: prompts, and the target's answers with its features;
- ``flow``: blocks, noisy states, flow times and the losses of the flow, distillation and
  DFlash-style stages; ``trainer``: the loop, data stream and options every drafter trainer
  shares; ``train_drafter`` (FlashMap, DFlash-style), ``train_eagle``, ``export_drafter``.

Diagnostics and evaluation:
- ``denoiser_curve`` (is it a flow; the flow stage's gate), ``shuffle_test``, ``heldout``,
  ``offline_acceptance``, with ``flow_diagnostics`` as their command; ``mode_probe``;
- ``joint_task`` (+ ``joint_task_report``): a synthetic task whose answer is known exactly;
- ``evaluate`` is ``flashmap eval``, over ``eval_methods`` and ``eval_report``.

``run_demo_pipeline.sh`` runs the whole demo chain.
"""
