"""Prompt token counting and the synthetic "model" output (text, ids, logprobs) of the simulator.

Counting uses the real SmolLM2 tokenizer and chat template from the converted model folder
(``usefulwork.backends.model.default_model_dir()``) when it exists: the ``tokenizers`` library
(Rust, loads in ~0.1 s, no torch/transformers import) plus the folder's Jinja chat template
rendered the way transformers does. So the simulator counts prompt tokens exactly like the real
local vLLM. Every catalog model is counted with this tokenizer (a documented stand-in: Llama-3's
tokenizer gives roughly 5-15% fewer tokens for English). Without the folder, a documented
approximation is used: one token per 4 UTF-8 bytes (rounded up), ids derived from the bytes.

Output text is a deterministic stream of common English words, each a single token in the real
tokenizer, so re-tokenizing the completion gives back completion_tokens.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

WORDS = (
    "the of and to in is that it for was on are as with be at this have from or by one had not but what all "
    "were when we there can an your which their said if do will each about how up out them then she many some "
    "so these would other into has more her two like him see time could no make than first been its who now "
    "people my made over did down only way find use may water long little very after words called just where "
    "most know get through back much before go good new write our used me man too any day same right look think "
    "also around another came come work three word must because does part even place well such here take why "
    "things help put years different away again off went old number great tell men say small every found still "
    "between name should home big give air line set own under read last never us left end along while might "
    "next sound below saw something thought both few those always looked show large often together asked house "
    "world going want school important until form food keep children feet land side without boy once animals "
    "life enough took sometimes four head above kind began almost live page got earth need far hand high year "
    "mother light parts country father let night following picture being study second eyes soon times story "
    "boys since white days ever paper hard near sentence better best across during today others however sure "
    "means knew try told young miles sun ways thing whole hear example heard several change answer room sea "
    "against top turned learn point city play toward five using himself usually"
).split()

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _content_text(content: Any) -> str:
    """OpenAI message content: a string or a list of parts; text parts join with newlines (as vLLM)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                texts.append(part)
        return "\n".join(texts)
    return str(content)


@dataclass
class TokenText:
    """One synthetic output token: id, text piece, and the text's bytes for logprobs."""

    id: int
    text: str


class SimTokenizer:
    """Counts prompt tokens and makes the synthetic output vocabulary."""

    def __init__(self, model_dir: Path | None = None):
        self.model_dir = model_dir
        self._tok = None
        self.exact = False
        self.eos_token = "<|im_end|>"
        self.bos_token = "<|im_start|>"
        template = DEFAULT_CHAT_TEMPLATE
        if model_dir is not None and (model_dir / "tokenizer.json").exists() and _has("tokenizers"):
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
            self.exact = True
            cfg_path = model_dir / "tokenizer_config.json"
            if cfg_path.exists():
                cfg = json.loads(cfg_path.read_text())
                self.eos_token = _token_str(cfg.get("eos_token")) or self.eos_token
                self.bos_token = _token_str(cfg.get("bos_token")) or self.bos_token
                template = cfg.get("chat_template") or template
            if (model_dir / "chat_template.jinja").exists():
                template = (model_dir / "chat_template.jinja").read_text()
        self._template = _compile_template(template)
        self.vocab = self._output_vocab()
        self.vocab_ids = [t.id for t in self.vocab]
        self._by_id = {t.id: t for t in self.vocab}

    # -- prompts --
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._tok is not None:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        data = text.encode("utf-8")
        # Approximation: ~4 bytes per token; ids from the bytes so equal prefixes give equal ids.
        return [int.from_bytes(data[i : i + 4].ljust(4, b"\0"), "little") % 50000 for i in range(0, len(data), 4)]

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        msgs = [{**m, "content": _content_text(m.get("content"))} for m in messages]
        return self._template.render(
            messages=msgs, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
            eos_token=self.eos_token, **kwargs,
        )

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        # The template already holds any special tokens: no extra BOS (vLLM does the same).
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    # -- outputs --
    def _output_vocab(self) -> list[TokenText]:
        out: list[TokenText] = []
        for w in WORDS:
            piece = " " + w
            if self._tok is not None:
                ids = self._tok.encode(piece, add_special_tokens=False).ids
                if len(ids) != 1:
                    continue  # keep only words that are one token, so text and counts agree
                out.append(TokenText(ids[0], piece))
            else:
                out.append(TokenText(100000 + len(out), piece))
        return out

    def piece(self, token_id: int) -> TokenText:
        return self._by_id.get(token_id) or TokenText(token_id, " token")


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


class _ChatMLTemplate:
    """Fallback without jinja2: ChatML, the SmolLM2 template's shape."""

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **_: Any) -> str:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _compile_template(source: str):
    # As transformers renders chat templates: sandboxed, trim_blocks + lstrip_blocks.
    if not _has("jinja2"):
        return _ChatMLTemplate()
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
    return env.from_string(source)


def approx_by_default() -> bool:
    """``USEFULWORK_SIM_TOKENIZER=approx``: with no folder named, count ~4 bytes a token even where the
    converted SmolLM2 folder exists."""
    return os.environ.get("USEFULWORK_SIM_TOKENIZER", "") == "approx"


@lru_cache(maxsize=4)
def load_tokenizer(model_dir: str | None = None) -> SimTokenizer:
    """The tokenizer for a folder (default: the converted SmolLM2 folder, if present)."""
    if model_dir is None and not approx_by_default():
        from usefulwork.backends.model import default_model_dir

        d = default_model_dir()
        return SimTokenizer(d if (d / "tokenizer.json").exists() else None)
    if model_dir in (None, "", "approx"):
        return SimTokenizer(None)
    return SimTokenizer(Path(model_dir))


def synthetic_logprobs(rng_seed: int, index: int, token_id: int, vocab_ids: Sequence[int], k: int) -> tuple[float, list[tuple[int, float]]]:
    """Deterministic logprobs: the sampled token is the most likely; k alternatives below it.

    Returns (logprob of the sampled token, [(token id, logprob)] for the top-k including it).
    """
    h = hash((rng_seed, index, 0x10C9))
    p_top = 0.35 + (h % 6000) / 10000.0  # 0.35 .. 0.95
    chosen = math.log(p_top)
    top: list[tuple[int, float]] = [(token_id, chosen)]
    rest = 1.0 - p_top
    n = len(vocab_ids)
    j = 1
    while len(top) < k and j <= n:
        alt = vocab_ids[(h // 7 + j * 31) % n]
        j += 1
        if any(alt == t for t, _ in top):
            continue
        rest *= 0.5
        top.append((alt, math.log(max(rest, 1e-12))))
    return chosen, top
