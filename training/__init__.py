"""Training of the small real target model that FlashMap Serve uses as its demo / default.

Everything here runs on CPU from local text only (no model or data hub):

- ``training.corpus``: builds three domains deterministically from a seed: code (the
  Python standard library sources of this interpreter), math (generated arithmetic and
  word problems with worked solutions) and chat (dialogues rendered with the chat
  template: docstring Q/A, arithmetic, small coding tasks, small talk). Each domain is
  split into training documents and held-out documents / prompts.
- ``training.tokenizer``: a byte-level BPE (``tokenizers``) with the Qwen special tokens
  (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``) and a Qwen-style chat template,
  saved so that ``transformers.AutoTokenizer`` loads it.
- ``training.train_target``: trains ``transformers.Qwen3ForCausalLM`` from a
  ``Qwen3Config`` and writes a standard Hugging Face checkpoint directory
  (``python -m training.train_target --out checkpoints/demo-target``).
"""
