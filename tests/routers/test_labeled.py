"""The labeled routing format: good rows, and bad lines named by file:line and field."""

from __future__ import annotations

import pytest

from usefulwork.routers.labeled import LabeledError, read_labeled


def write(tmp_path, text: str):
    p = tmp_path / "l.jsonl"
    p.write_text(text)
    return p


def test_prompt_and_messages_rows(tmp_path):
    p = write(tmp_path, '{"prompt": "hi", "label": "small"}\n\n'
                        '{"messages": [{"role": "user", "content": "plan"}], "label": "large"}\n')
    ex = read_labeled(p)
    assert [e.label for e in ex] == ["small", "large"]
    assert ex[0].body == {"messages": [{"role": "user", "content": "hi"}]}
    assert ex[1].where == f"{p}:3" and ex[1].text == "user: plan"


@pytest.mark.parametrize("line, message", [
    ("{not json", r":2: not valid JSON"),
    ('["a"]', r":2: each line must be a JSON object"),
    ('{"prompt": "x"}', r":2: label: missing"),
    ('{"prompt": "x", "label": "medium"}', r":2: label: 'medium' is not one of small, large"),
    ('{"label": "small"}', r":2: prompt: missing"),
    ('{"prompt": "", "label": "small"}', r":2: prompt: must be a non-empty string"),
    ('{"messages": [], "label": "small"}', r":2: messages: must be a non-empty list"),
])
def test_a_bad_line_is_named_by_file_and_line(tmp_path, line, message):
    p = write(tmp_path, '{"prompt": "ok", "label": "small"}\n' + line + "\n")
    with pytest.raises(LabeledError, match=str(p).replace(".", r"\.") + message):
        read_labeled(p)


def test_eval_rows_may_lack_labels_and_empty_files_fail(tmp_path):
    assert read_labeled(write(tmp_path, '{"prompt": "x"}\n'), require_label=False)[0].label is None
    with pytest.raises(LabeledError, match="no examples"):
        read_labeled(write(tmp_path, "\n"))
    with pytest.raises(LabeledError, match="cannot read"):
        read_labeled(tmp_path / "missing.jsonl")
