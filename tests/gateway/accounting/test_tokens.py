"""Token estimates for cut streams: SSE text extraction, the real tokenizer, the documented fallback."""

from __future__ import annotations

import math
from pathlib import Path

from usefulwork.gateway.accounting.tokens import CHARS_PER_TOKEN, TOKENS_PER_MESSAGE, TokenEstimator, streamed_text


def test_streamed_text_reads_chat_and_completions_chunks_and_ignores_the_rest():
    events = [
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\ndata: {"choices":[{"index":0,"delta":{"content":" there"}}]}\n\n',
        b'data: {"choices":[{"index":0,"text":"!"}]}\n\n',
        b": keep-alive comment\n\n",
        b"data: not json\n\n",
        b'data: {"choices":[],"usage":null}\n\n',
        b"data: [DONE]\n\n",
    ]
    assert streamed_text(events) == ("Hi there!", 3)


def test_fallback_without_a_tokenizer_folder(tmp_path: Path):
    est = TokenEstimator(tmp_path)  # no tokenizer.json there
    assert est.count_text("abcdefghi") == math.ceil(9 / CHARS_PER_TOKEN)
    msgs = [{"role": "system", "content": "abcd"}, {"role": "user", "content": [{"type": "text", "text": "abcdefgh"}]}]
    assert est.count_prompt(msgs) == 1 + 2 + 2 * TOKENS_PER_MESSAGE
    assert est.count_prompt([1, 2, 3]) == 3  # completions prompt given as token ids
    assert est.count_prompt(["abcd", "abcd"]) == 2
    assert est.method == "chars/4"


def test_real_tokenizer_counts_match_transformers():
    from transformers import PreTrainedTokenizerFast

    from usefulwork.backends.model import ensure_model

    folder = ensure_model()
    est = TokenEstimator(folder)
    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    text = "The quick brown fox jumps over the lazy dog, twice."
    assert est.count_text(text) == len(tok.encode(text, add_special_tokens=False))
    assert est.count_prompt(text) == est.count_text(text)
    assert est.method == "tokenizer"
    events = [b'data: {"choices":[{"index":0,"text":"' + w.encode() + b'"}]}\n\n' for w in ["The quick", " brown fox"]]
    assert est.count_completion(events) == len(tok.encode("The quick brown fox", add_special_tokens=False))
