"""The semantic cache's vectors: one nearest-neighbour index per partition, in this process.

A partition starts as a numpy matrix searched exactly (a few thousand dot products cost less than
any graph walk); past ``hnsw_min`` entries it moves to a faiss HNSW graph (inner product on unit
vectors = cosine). The choice of faiss over hnswlib, usearch and Redis's own vector search is
measured in benchmarks/cache_index.py (docs/architecture.md, "Semantic cache index").

Removals (expiry, eviction, purge) are tombstones: the graph keeps the vector, searches skip it,
and the partition is rebuilt once tombstones pass a quarter of its rows.
"""

from __future__ import annotations

import numpy as np

from usefulwork.embedding import DIM

HNSW_M = 32
HNSW_EF_CONSTRUCTION = 80
HNSW_EF_SEARCH = 64


class PartitionIndex:
    def __init__(self, hnsw_min: int):
        self.hnsw_min = hnsw_min
        self._vecs = np.empty((0, DIM), dtype=np.float32)
        self._n = 0  # rows used in _vecs
        self._keys: list[str | None] = []  # row -> key (None: removed)
        self._row: dict[str, int] = {}  # key -> row
        self._hnsw = None  # faiss.IndexHNSWFlat once the partition is large

    def __len__(self) -> int:
        return len(self._row)

    def add(self, key: str, vec: np.ndarray) -> None:
        if key in self._row:  # same key, same conversation, same vector (a replica's own write echoed back)
            return
        if self._n == len(self._vecs):
            grown = np.empty((max(64, 2 * len(self._vecs)), DIM), dtype=np.float32)
            grown[:self._n] = self._vecs[:self._n]
            self._vecs = grown
        self._vecs[self._n] = vec
        self._row[key] = self._n
        self._keys.append(key)
        self._n += 1
        if self._hnsw is not None:
            self._hnsw.add(vec.reshape(1, DIM))
        elif len(self._row) >= self.hnsw_min:
            self._rebuild()

    def remove(self, key: str) -> None:
        row = self._row.pop(key, None)
        if row is None:
            return
        self._keys[row] = None
        if self._n - len(self._row) > max(64, self._n // 4):
            self._rebuild()

    def _rebuild(self) -> None:
        live = [(k, r) for k, r in self._row.items()]
        vecs = self._vecs[[r for _, r in live]] if live else np.empty((0, DIM), dtype=np.float32)
        self._vecs = np.ascontiguousarray(vecs, dtype=np.float32)
        self._n = len(live)
        self._keys = [k for k, _ in live]
        self._row = {k: i for i, k in enumerate(self._keys)}
        self._hnsw = None
        if self._n >= self.hnsw_min:
            import faiss  # noqa: PLC0415 (only when a partition grows large)
            # One query at a time gains nothing from OpenMP; its hand-offs between threads on busy
            # cores are what made the p99 (docs/benchmarks.md section 9).
            faiss.omp_set_num_threads(1)
            index = faiss.IndexHNSWFlat(DIM, HNSW_M, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
            index.hnsw.efSearch = HNSW_EF_SEARCH
            index.add(self._vecs[:self._n])
            self._hnsw = index

    def search(self, vec: np.ndarray, k: int = 4) -> list[tuple[str, float]]:
        """Up to ``k`` live (key, cosine) pairs, best first."""
        if not self._row:
            return []
        if self._hnsw is None:
            scores = self._vecs[:self._n] @ vec
            want = min(k + (self._n - len(self._row)), self._n)
            top = np.argpartition(-scores, want - 1)[:want] if want < self._n else np.arange(self._n)
            top = top[np.argsort(-scores[top])]
            pairs = [(self._keys[i], float(scores[i])) for i in top]
        else:
            want = k + min(16, self._n - len(self._row))
            scores, rows = self._hnsw.search(vec.reshape(1, DIM), want)
            pairs = [(self._keys[r], float(s)) for s, r in zip(scores[0], rows[0]) if r >= 0]
        return [(key, s) for key, s in pairs if key is not None][:k]


class VectorIndex:
    """Every partition's index; also the store's listener, so it follows adds, removals and purges."""

    def __init__(self, hnsw_min: int = 2048):
        self.hnsw_min = hnsw_min
        self._parts: dict[str, PartitionIndex] = {}

    def size(self, partition: str) -> int:
        p = self._parts.get(partition)
        return 0 if p is None else len(p)

    def __len__(self) -> int:
        return sum(len(p) for p in self._parts.values())

    def search(self, partition: str, vec: np.ndarray, k: int = 4) -> list[tuple[str, float]]:
        p = self._parts.get(partition)
        return [] if p is None else p.search(vec, k)

    # -- StoreListener --
    def added(self, entry) -> None:
        if entry.vector is None:
            return
        p = self._parts.get(entry.partition)
        if p is None:
            p = self._parts[entry.partition] = PartitionIndex(self.hnsw_min)
        p.add(entry.key, entry.vector)

    def removed(self, partition: str, key: str) -> None:
        p = self._parts.get(partition)
        if p is not None:
            p.remove(key)
            if not len(p):
                del self._parts[partition]

    def purged(self, partitions: list[str]) -> None:
        for partition in partitions:
            self._parts.pop(partition, None)
