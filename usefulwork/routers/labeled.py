"""The labeled routing format `usefulwork router train` and `eval` read.

One JSON object a line: ``{"prompt": "...", "label": "small" | "large"}``, or ``"messages"`` (an
OpenAI chat list) instead of ``"prompt"``. ``label`` may be missing for ``eval`` (then no accuracy
is reported for that row). Blank lines are skipped. A bad line raises ``LabeledError`` naming
``file:line`` and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from usefulwork.embedding import conversation_text

LABELS = ("small", "large")


class LabeledError(ValueError):
    """A labeled file that cannot be used; the message starts with ``file:line``."""


@dataclass(frozen=True, slots=True)
class Example:
    body: dict[str, Any]  # a request body: {"messages": [...]} or {"prompt": "..."}
    label: str | None
    where: str  # file:line

    @property
    def text(self) -> str:
        return conversation_text(self.body)


def read_labeled(path: str | Path, require_label: bool = True) -> list[Example]:
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as exc:
        raise LabeledError(f"{p}: cannot read: {exc.strerror}") from None
    out = []
    for i, line in enumerate(lines, 1):
        where = f"{p}:{i}"
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LabeledError(f"{where}: not valid JSON: {exc.msg}") from None
        if not isinstance(row, dict):
            raise LabeledError(f"{where}: each line must be a JSON object")
        label = row.get("label")
        if label is None and require_label:
            raise LabeledError(f"{where}: label: missing (one of {', '.join(LABELS)})")
        if label is not None and label not in LABELS:
            raise LabeledError(f"{where}: label: {label!r} is not one of {', '.join(LABELS)}")
        if "messages" in row:
            msgs = row["messages"]
            if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
                raise LabeledError(f"{where}: messages: must be a non-empty list of objects")
            body: dict[str, Any] = {"messages": msgs}
        elif "prompt" in row:
            if not isinstance(row["prompt"], str) or not row["prompt"].strip():
                raise LabeledError(f"{where}: prompt: must be a non-empty string")
            body = {"messages": [{"role": "user", "content": row["prompt"]}]}
        else:
            raise LabeledError(f"{where}: prompt: missing (give \"prompt\" or \"messages\")")
        out.append(Example(body, label, where))
    if not out:
        raise LabeledError(f"{p}: no examples")
    return out
