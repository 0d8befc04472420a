"""The target checkpoint's tokenizer, without torch or transformers.

Reads tokenizer.json with the `tokenizers` library (what transformers' fast tokenizer
wraps), so the orchestrator stays light. Chat templates are applied by
transformers where a caller wants them; serving takes text or ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from flashmap.types import InvalidRequest


class TextTokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer in the target checkpoint (pass token ids instead)")
        self.tok = Tokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}

    def encode(self, text: str) -> list[int]:
        if not text:
            raise InvalidRequest("prompt is empty")
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)


class IncrementalDecoder:
    """Turns a growing id list into text deltas without splitting multi-byte characters."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more ids
            return ""
        delta, self.text = text[len(self.text):], text
        return delta
