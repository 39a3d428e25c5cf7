"""Validate OpenAI request bodies before anything is forwarded.

Hand-written checks rather than a pydantic model: this runs on every request, the checks are few,
and a dict walk costs a few microseconds where model validation costs tens. Only what the gateway
must rely on (or what would otherwise fail late, upstream) is checked; unknown fields pass through
to vLLM untouched, since vLLM accepts many extensions (ignore_eos, min_tokens, ...).

Hostile shapes are refused before anything else looks at them: a body nested deeper than
``MAX_JSON_DEPTH`` is a 400 (orjson cannot re-encode past 254 levels, ``repr`` recurses), and error
messages show a value's type, or a short prefix, never the whole value.
"""

from __future__ import annotations

from typing import Any

import orjson

from usefulwork.gateway.errors import GatewayError

_ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})
MAX_JSON_DEPTH = 64  # nested objects/arrays in a request body; OpenAI's own shapes need fewer than 10


def _bad(param: str, message: str) -> GatewayError:
    return GatewayError(422, message, param=param, code="invalid_value")


def _show(v: Any) -> str:
    """A value for an error message: short, and never a recursive repr of a container."""
    if isinstance(v, (dict, list)):
        return "an object" if isinstance(v, dict) else "a list"
    text = repr(v)
    return text if len(text) <= 40 else text[:40] + "..."


def _too_deep(body: Any) -> bool:
    stack = [(body, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return True
        for x in v.values() if isinstance(v, dict) else v:
            if isinstance(x, (dict, list)):
                stack.append((x, depth + 1))
    return False


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def parse_json(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise GatewayError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        why = str(exc.args[0] if exc.args else exc)
        if "recursion" in why:
            why = f"it nests deeper than {MAX_JSON_DEPTH} levels"
        raise GatewayError(400, f"request body is not valid JSON: {why}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise GatewayError(400, f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    # one C-speed count rules out deep nesting for nearly every body; only bracket-heavy ones are walked
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _too_deep(body):
        raise GatewayError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    return body


def _check_common(body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is None:
        raise _bad("model", "'model' is required")
    if not isinstance(model, str) or not model:
        raise _bad("model", "'model' must be a non-empty string")
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and (not _is_int(v) or v < 1):
            raise _bad(key, f"'{key}' must be an integer >= 1, got {_show(v)}")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n < 1):
        raise _bad("n", f"'n' must be an integer >= 1, got {_show(n)}")
    t = body.get("temperature")
    if t is not None and (not _is_num(t) or not 0 <= t <= 2):
        raise _bad("temperature", f"'temperature' must be a number in [0, 2], got {_show(t)}")
    p = body.get("top_p")
    if p is not None and (not _is_num(p) or not 0 <= p <= 1):
        raise _bad("top_p", f"'top_p' must be a number in [0, 1], got {_show(p)}")
    s = body.get("stream")
    if s is not None and not isinstance(s, bool):
        raise _bad("stream", f"'stream' must be a boolean, got {_show(s)}")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("stream_options", "'stream_options' must be an object")
        iu = so.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise _bad("stream_options.include_usage", "'stream_options.include_usage' must be a boolean")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(x, str) for x in stop))):
        raise _bad("stop", "'stop' must be a string or a list of strings")


def validate_chat(body: dict[str, Any]) -> None:
    _check_common(body)
    msgs = body.get("messages")
    if msgs is None:
        raise _bad("messages", "'messages' is required")
    if not isinstance(msgs, list):
        raise _bad("messages", "'messages' must be a list of message objects")
    if not msgs:
        raise _bad("messages", "'messages' must not be empty")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"messages[{i}] must be an object")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise _bad(f"messages[{i}].role", f"messages[{i}].role must be one of {sorted(_ROLES)}, got {_show(role)}")
        content = m.get("content")
        if content is None:
            if role == "assistant" and (m.get("tool_calls") or m.get("function_call")):
                continue
            raise _bad(f"messages[{i}].content", f"messages[{i}].content is required")
        if not isinstance(content, (str, list)):
            raise _bad(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of parts")


def validate_completion(body: dict[str, Any]) -> None:
    _check_common(body)
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("prompt", "'prompt' is required")
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(x, str) for x in prompt) or all(_is_int(x) for x in prompt):
            return
        if all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in prompt):
            return
    raise _bad("prompt", "'prompt' must be a string, a non-empty list of strings, or token id lists")


def validate_responses(body: dict[str, Any]) -> None:
    """``POST /v1/responses``: ``input`` is a string or a list of input items."""
    _check_common(body)
    inp = body.get("input")
    if inp is None:
        raise _bad("input", "'input' is required")
    if isinstance(inp, str):
        if not inp:
            raise _bad("input", "'input' must not be empty")
    elif isinstance(inp, list):
        if not inp:
            raise _bad("input", "'input' must not be empty")
        for i, item in enumerate(inp):
            if not isinstance(item, dict):
                raise _bad(f"input[{i}]", f"input[{i}] must be an object")
    else:
        raise _bad("input", "'input' must be a string or a list of input items")
    v = body.get("max_output_tokens")
    if v is not None and (not _is_int(v) or v < 1):
        raise _bad("max_output_tokens", f"'max_output_tokens' must be an integer >= 1, got {v!r}")
    prev = body.get("previous_response_id")
    if prev is not None and not (isinstance(prev, str) and prev):
        raise _bad("previous_response_id", "'previous_response_id' must be a response id (a non-empty string)")
    if body.get("background"):
        # its work would run after the answer: outside admission control (no slot held) and the ledger (no usage)
        raise GatewayError(400, "background responses are not served through this gateway: their work would run "
                           "outside its admission control and accounting; send the request without 'background'",
                           param="background", code="unsupported_parameter")


def validate_embeddings(body: dict[str, Any]) -> None:
    """``POST /v1/embeddings``: ``input`` is a string, a list of strings, or token id list(s)."""
    _check_common(body)
    inp = body.get("input")
    if inp is None:
        raise _bad("input", "'input' is required")
    if isinstance(inp, str) and inp:
        return
    if isinstance(inp, list) and inp:
        if all(isinstance(x, str) for x in inp) or all(_is_int(x) for x in inp):
            return
        if all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in inp):
            return
    raise _bad("input", "'input' must be a non-empty string, list of strings, or token id list(s)")


# -- the output limit, across endpoints ---------------------------------------------------------------

_OUTPUT_LIMITS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def max_tokens_of(body: dict[str, Any]) -> int | None:
    """The output limit a (validated) request asks for, as vLLM reads it: a chat request's
    ``max_completion_tokens`` over its ``max_tokens``; the Responses API's ``max_output_tokens``."""
    for key in _OUTPUT_LIMITS:
        v = body.get(key)
        if v is not None and _is_int(v):
            return v
    return None


def with_max_tokens(body: dict[str, Any], op: str, n: int) -> dict[str, Any]:
    """A copy of ``body`` whose output limit is ``n``, in its endpoint's own field (the Responses API's
    ``max_output_tokens``; else ``max_tokens``, replacing a chat request's ``max_completion_tokens``,
    which vLLM would read first)."""
    out = dict(body)
    if op == "responses":
        out["max_output_tokens"] = n
    else:
        out["max_tokens"] = n
        out.pop("max_completion_tokens", None)
    return out


# -- the text of a request, across endpoints ----------------------------------------------------------


def _text_of(content: Any) -> str | None:
    """A message's text: a string, or a content list's text parts joined by newlines as vLLM renders them
    (None: no text, as a tool call)."""
    if isinstance(content, list):
        return "\n".join(t for p in content if isinstance(p, dict) and isinstance(t := p.get("text", ""), str))
    return content if isinstance(content, str) else None


def messages_of(body: dict[str, Any], op: str | None = None) -> list[tuple[str, str | None]] | None:
    """(role, text) of a chat request's messages, or of a Responses request's ``instructions`` (as the
    system message vLLM makes of them) and ``input`` (its items, or its one string as the user's); None
    for a request with a plain prompt (completions, embeddings). A string ``input`` without instructions
    is a Responses request's only when ``op`` says so (vLLM renders every Responses request as a chat);
    without ``op`` it reads as a plain prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        items = messages
        out: list[tuple[str, str | None]] = []
    else:
        inp, instructions = body.get("input"), body.get("instructions")
        has_items = isinstance(inp, list) and any(isinstance(x, dict) for x in inp)
        chat_string = isinstance(inp, str) and (op == "responses" or (isinstance(instructions, str) and instructions))
        if not has_items and not chat_string:
            return None
        out = [("system", instructions)] if isinstance(instructions, str) and instructions else []
        if isinstance(inp, str):
            return [*out, ("user", inp)]
        items = inp
    for m in items:
        if isinstance(m, dict):
            out.append((str(m.get("role", "user")), _text_of(m.get("content"))))
    return out


def prompt_of(body: dict[str, Any]) -> str:
    """A plain prompt's text: ``prompt`` (completions) or ``input`` (embeddings, Responses), a list's
    strings joined."""
    prompt = body.get("prompt", body.get("input", ""))
    if isinstance(prompt, list):
        return "\n".join(p for p in prompt if isinstance(p, str))
    return prompt if isinstance(prompt, str) else ""
