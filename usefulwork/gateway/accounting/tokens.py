"""Token counts for requests whose upstream never reported usage (a stream cut before the end).

The count uses the model's own tokenizer: the transformers *fast* tokenizer of the converted model
folder (``usefulwork.backends.model.default_model_dir()``, or ``USEFULWORK_TOKENIZER_DIR``). The
prompt is counted through the model's chat template, as vLLM counts it. Without a tokenizer
(no folder, or transformers missing) the documented fallback is OpenAI's rule of thumb: one token
per 4 characters of text (rounded up), plus 4 tokens of chat framing per message. Either way the
record says ``usage_source="estimate"``.

Loading the tokenizer takes a while and tokenizing is CPU work, so the accountant calls this from a
worker thread, never on the event loop.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from pathlib import Path
from typing import Any, Iterable

import orjson

log = logging.getLogger("usefulwork.tokens")

CHARS_PER_TOKEN = 4  # fallback: OpenAI's published rule of thumb for English text
TOKENS_PER_MESSAGE = 4  # fallback: role markers and separators around each chat message


def streamed_text(events: Iterable[bytes]) -> tuple[str, int]:
    """Concatenate the generated text in forwarded SSE events; also return the content-chunk count.

    Events are raw bytes as forwarded, possibly several ``data:`` lines per chunk.
    """
    parts: list[str] = []
    chunks = 0
    for raw in events:
        for line in raw.splitlines():
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            body = line[5:].strip()
            if not body or body == b"[DONE]":
                continue
            try:
                obj = orjson.loads(body)
            except orjson.JSONDecodeError:
                continue
            for choice in obj.get("choices") or ():
                delta = choice.get("delta")
                text = (delta.get("content") if isinstance(delta, dict) else None) or choice.get("text") or ""
                if isinstance(delta, dict) and delta.get("reasoning_content"):
                    text = delta["reasoning_content"] + text
                if text:
                    parts.append(text)
                    chunks += 1
    return "".join(parts), chunks


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


class TokenEstimator:
    """Counts tokens with the model's tokenizer when available, else with the fallback rule."""

    def __init__(self, tokenizer_dir: Path | None = None):
        self._dir = tokenizer_dir
        self._tok: Any = None
        self._loaded = False
        self._lock = threading.Lock()
        self.method = "unloaded"

    @staticmethod
    def default_dir() -> Path | None:
        env = os.environ.get("USEFULWORK_TOKENIZER_DIR")
        if env:
            return Path(env)
        try:
            from usefulwork.backends.model import default_model_dir
        except ImportError:
            return None
        return default_model_dir()

    def _load(self) -> Any:
        with self._lock:
            if self._loaded:
                return self._tok
            self._loaded = True
            folder = self._dir or self.default_dir()
            if folder is None or not (folder / "tokenizer.json").exists():
                self.method = "chars/4"
                log.info("no tokenizer at %s: estimating tokens as chars/%d", folder, CHARS_PER_TOKEN)
                return None
            try:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                from transformers import PreTrainedTokenizerFast

                self._tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
                self.method = "tokenizer"
            except Exception as exc:  # a broken folder must not break accounting
                log.warning("cannot load tokenizer from %s (%s): estimating tokens as chars/%d",
                            folder, exc, CHARS_PER_TOKEN)
                self.method = "chars/4"
            return self._tok

    # -- counting --
    def count_text(self, text: str) -> int:
        if not text:
            return 0
        tok = self._load()
        if tok is None:
            return math.ceil(len(text) / CHARS_PER_TOKEN)
        return len(tok.encode(text, add_special_tokens=False))

    def count_prompt(self, payload: Any) -> int:
        """Prompt tokens of a chat ``messages`` list or a completions ``prompt``."""
        if payload is None:
            return 0
        tok = self._load()
        if isinstance(payload, list) and payload and isinstance(payload[0], dict):  # chat messages
            if tok is not None and getattr(tok, "chat_template", None):
                try:
                    ids = tok.apply_chat_template(
                        [{"role": m.get("role", "user"), "content": _message_text(m.get("content"))} for m in payload],
                        tokenize=True, add_generation_prompt=True)
                    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                        ids = ids["input_ids"]
                    return len(ids)
                except Exception:
                    pass  # an odd message shape: count the texts instead
            return sum(self.count_text(_message_text(m.get("content"))) + TOKENS_PER_MESSAGE for m in payload)
        if isinstance(payload, list):  # completions: a list of prompts, or token ids
            if all(isinstance(x, int) for x in payload):
                return len(payload)
            return sum(self.count_prompt(x) for x in payload)
        return self.count_text(_message_text(payload))

    def count_completion(self, events: Iterable[bytes] | None) -> int:
        if not events:
            return 0
        text, _ = streamed_text(events)
        return self.count_text(text)
