"""The worker's view of a model's tokenizer: token ids ↔ text, nothing more.

Workers receive token ids: prompts are tokenized (and chat templates rendered) in the gateway,
which fetches the files it needs from `GET /internal/tokenizer`. The engine only decodes its
output (and the offline tools encode plain text).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer


def tokenizer_payload(folder: Path) -> dict[str, Any]:
    """The files a gateway needs to tokenize for a model, read from its folder (JSON-ready)."""
    config_path = folder / "tokenizer_config.json"
    template_path = folder / "chat_template.jinja"
    return {
        "tokenizer_json": (folder / "tokenizer.json").read_text(),
        "tokenizer_config": json.loads(config_path.read_text()) if config_path.exists() else {},
        "chat_template": template_path.read_text() if template_path.exists() else None,
    }


class TokenCodec:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def from_folder(cls, folder: Path) -> TokenCodec:
        return cls(Tokenizer.from_file(str(folder / "tokenizer.json")))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
