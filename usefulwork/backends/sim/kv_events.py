"""The simulator's KV-cache event publisher: vLLM's ``--kv-events-config`` ZMQ wire format.

vLLM (``vllm/distributed/kv_events.py``, 0.32) publishes on a ZMQ PUB socket, one multipart message
per engine step: ``[topic, seq (8-byte big-endian), msgpack(EventBatch)]``. ``EventBatch`` is an
array ``[ts, events, data_parallel_rank]``; each event is a map tagged by ``type``: ``BlockStored``
(``block_hashes``, ``parent_block_hash``, ``token_ids`` of those blocks, ``block_size``, ``lora_id``,
``medium``, ``lora_name``), ``BlockRemoved`` (``block_hashes``, ``medium``) or ``AllBlocksCleared``.
The simulator's events come from its KV cache (``sim/kvcache.py``) and are encoded the same way,
so a subscriber (``usefulwork/upstream/kv_events.py``) reads either server.

Config (JSON, vLLM's keys): ``{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "topic": ""}``. Needs ``pyzmq`` and ``msgspec`` (the ``kv-events`` extra).
"""

from __future__ import annotations

import json
import itertools
from typing import Any


def parse_config(text: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's --kv-events-config JSON -> settings, or None when events are off."""
    if not text:
        return None
    cfg = json.loads(text) if isinstance(text, str) else dict(text)
    if not isinstance(cfg, dict):
        raise ValueError("--kv-events-config: must be a JSON object")
    if not cfg.get("enable_kv_cache_events"):
        return None
    if cfg.get("publisher", "zmq") not in ("zmq", "null"):
        raise ValueError(f"--kv-events-config: publisher: {cfg['publisher']!r} (zmq or null)")
    return cfg


class ZmqKvEventPublisher:
    def __init__(self, endpoint: str = "tcp://*:5557", topic: str = "", hwm: int = 100_000, **_: Any):
        import msgspec  # noqa: PLC0415 (the kv-events extra)
        import zmq  # noqa: PLC0415

        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._topic = topic.encode()
        self._seq = itertools.count()
        self._encode = msgspec.msgpack.Encoder().encode
        self._noblock = zmq.NOBLOCK
        self.published = 0

    def publish(self, events: list[dict[str, Any]], ts: float) -> None:
        payload = self._encode([ts, events, 0])
        try:
            self._pub.send_multipart((self._topic, next(self._seq).to_bytes(8, "big"), payload), flags=self._noblock)
            self.published += len(events)
        except Exception:  # a full queue drops events, as vLLM's high-water mark does
            pass

    def close(self) -> None:
        self._pub.close(linger=0)


def build_publisher(config: str | dict[str, Any] | None) -> ZmqKvEventPublisher | None:
    cfg = parse_config(config)
    if cfg is None or cfg.get("publisher", "zmq") == "null":
        return None
    return ZmqKvEventPublisher(**{k: v for k, v in cfg.items() if k in ("endpoint", "topic", "hwm")})
