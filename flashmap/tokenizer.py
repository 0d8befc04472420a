"""The target checkpoint's tokenizer, without torch or transformers.

Reads tokenizer.json with the `tokenizers` library (what transformers' fast tokenizer
wraps), so the orchestrator stays light. Chat templates are applied by
transformers where a caller wants them; serving takes text or ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

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
    """Turns a growing id list into text deltas in O(1) per token (the tokenizers library's
    DecodeStream), never splitting a multi-byte character. `ends[i]` is the length of the
    text once token i is decoded, so a caller can cut ids and text at the same place."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self.ids: list[int] = []
        self.ends: list[int] = []  # [len(ids)] text length after each token
        self.text = ""

    def push(self, new_ids: list[int]) -> str:
        start = len(self.text)
        for t in new_ids:
            piece = self._stream.step(self.tokenizer.tok, int(t))
            if piece:  # None while a character is incomplete
                self.text += piece
            self.ids.append(int(t))
            self.ends.append(len(self.text))
        return self.text[start:]
