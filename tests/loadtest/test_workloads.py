"""Workloads and trace parsers: lengths, shared prefixes, the built-in set, and line-numbered errors."""

import json
from itertools import islice

import numpy as np
import pytest

from usefulwork.loadtest import traces, workloads
from usefulwork.loadtest.traces import TraceError
from usefulwork.loadtest.workloads import Lengths, WorkloadError


def _take(w, n, seed=0):
    return list(islice(w.requests(np.random.default_rng(seed)), n))


def test_synthetic_fixed_lengths_word_per_token():
    w = workloads.from_spec({"type": "synthetic", "prompt_tokens": 512, "output_tokens": 128})
    specs = _take(w, 5)
    for s in specs:
        assert s.endpoint == "completions" and s.max_tokens == 128 and s.input_tokens == 512
        assert len(s.prompt.split()) == 512  # one word per planned token
        body = s.body("m")
        assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    assert len({s.prompt for s in specs}) == 5  # random prompts: no accidental prefix-cache hits


def test_synthetic_distributions_and_prefix_groups():
    w = workloads.from_spec({"type": "synthetic", "prompt_tokens": {"dist": "uniform", "min": 100, "max": 200},
                             "output_tokens": {"dist": "normal", "mean": 50, "std": 5},
                             "shared_prefix": {"groups": 3, "prefix_tokens": 40}})
    specs = _take(w, 300)
    ins = np.array([s.input_tokens for s in specs])
    outs = np.array([s.max_tokens for s in specs])
    assert ins.min() >= 100 and ins.max() <= 200 and abs(ins.mean() - 150) < 6
    assert abs(outs.mean() - 50) < 1.5
    groups = {s.kind for s in specs}
    assert groups == {"prefix-0", "prefix-1", "prefix-2"}
    by_group = {}
    for s in specs:
        head = " ".join(s.prompt.split()[:39])
        by_group.setdefault(s.kind, set()).add(head)
    assert all(len(heads) == 1 for heads in by_group.values())  # same group, same prefix
    assert len({next(iter(h)) for h in by_group.values()}) == 3


def test_length_spec_errors():
    with pytest.raises(WorkloadError, match="prompt_tokens: need 1 <= min <= max"):
        Lengths.parse({"dist": "uniform", "min": 5, "max": 1}, "prompt_tokens")
    with pytest.raises(WorkloadError, match="unknown distribution 'zipf'"):
        Lengths.parse({"dist": "zipf"}, "output_tokens")
    with pytest.raises(WorkloadError, match="does not take colour"):
        workloads.from_spec({"type": "synthetic", "colour": "red"})
    with pytest.raises(WorkloadError, match="unknown workload type 'nope'"):
        workloads.from_spec({"type": "nope"})


def test_realistic_set_mixes_simple_and_complex():
    w = workloads.realistic()
    d = w.describe()
    assert d["kinds"]["simple"] >= 20 and d["kinds"]["complex"] >= 12
    specs = _take(w, 80)
    assert all(s.endpoint == "chat" and s.messages for s in specs)
    assert not any(s.ignore_eos for s in specs)  # natural stops
    simple = [s.max_tokens for s in specs if s.kind == "simple"]
    complex_ = [s.max_tokens for s in specs if s.kind == "complex"]
    assert max(simple) < min(complex_)


def test_jsonl_prompts_and_line_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi there", "max_tokens": 5}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    w = workloads.from_spec({"type": "jsonl", "path": str(f), "max_tokens": 9})
    a, b = _take(w, 2, seed=1)
    assert {a.max_tokens, b.max_tokens} == {5, 9}
    f.write_text('{"prompt": "ok"}\n{"prompt": "a", "max_tokens": 0}\n')
    with pytest.raises(WorkloadError, match=r"p\.jsonl:2: max_tokens must be a positive integer"):
        workloads.jsonl_file(f)
    f.write_text('{"prompt": "ok"}\n{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(WorkloadError, match=r"p\.jsonl:3: not valid JSON"):
        workloads.jsonl_file(f)
    f.write_text('{"text": "x"}\n')
    with pytest.raises(WorkloadError, match=r"p\.jsonl:1: each line needs a 'prompt'"):
        workloads.jsonl_file(f)


MOONCAKE = [
    {"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]},
    {"timestamp": 500, "input_length": 700, "output_length": 20, "hash_ids": [1, 3]},
    {"timestamp": 2000, "input_length": 100, "output_length": 5, "hash_ids": [9]},
]


def test_mooncake_timing_scaling_and_shared_blocks(tmp_path):
    f = tmp_path / "mc.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in MOONCAKE) + "\n")
    w = traces.load("mooncake", f, speedup=2.0, max_output_tokens=15)
    specs = _take(w, 10)
    assert [s.at for s in specs] == [0.0, 0.25, 1.0]
    assert [s.max_tokens for s in specs] == [10, 15, 5]
    assert [s.input_tokens for s in specs] == [600, 700, 100]
    # block 1 (512 tokens) is shared by the first two requests, block 2 vs 3 differ
    w0, w1 = specs[0].prompt.split(), specs[1].prompt.split()
    assert len(w0) == 600 and len(w1) == 700
    assert w0[:512] == w1[:512] and w0[512:600] != w1[512:600]
    assert w.describe()["replay_span_s"] == 1.0


def test_burstgpt_and_azure(tmp_path):
    b = tmp_path / "b.csv"
    b.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "5,ChatGPT,100,20,120,Conversation log\n7.5,GPT-4,50,0,50,Conversation log\n9,GPT-4,30,40,70,API log\n")
    specs = _take(traces.load("burstgpt", b), 10)
    assert [(s.at, s.input_tokens, s.max_tokens) for s in specs] == [(0.0, 100, 20), (4.0, 30, 40)]
    a = tmp_path / "a.csv"
    a.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                 "2023-11-16 18:15:50.9951690,396,109\n")
    specs = _take(traces.load("azure", a, speedup=0.5), 10)
    assert specs[0].at == 0.0 and specs[1].at == pytest.approx(2 * 4.314579, abs=1e-5)
    assert [s.max_tokens for s in specs] == [44, 109]


@pytest.mark.parametrize("fmt,content,message", [
    ("mooncake", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1, "input_length": 5}\n',
     r"mc:2: missing field 'output_length'"),
    ("mooncake", '{"timestamp": 0, "input_length": 5, "output_length": 1}\nnot json\n', r"mc:2: not valid JSON"),
    ("mooncake", '{"timestamp": 0, "input_length": "x", "output_length": 1}\n', r"mc:1: input_length must be an integer"),
    ("mooncake", '{"timestamp": 9, "input_length": 5, "output_length": 1}\n{"timestamp": 3, "input_length": 5, '
     '"output_length": 1}\n', r"mc:2: timestamp goes backwards"),
    ("burstgpt", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,a,10,5,15,x\n2,a,ten,5,15,x\n",
     r"mc:3: Request tokens must be an integer, got 'ten'"),
    ("burstgpt", "Time,Model\n1,a\n", r"mc:1: CSV header lacks column 'Timestamp'"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3,4\nyesterday,3,4\n",
     r"mc:3: TIMESTAMP is not a date-time: 'yesterday'"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3\n", r"mc:2: expected 3 columns, got 2"),
])
def test_malformed_traces_name_the_line(tmp_path, fmt, content, message):
    f = tmp_path / "mc"
    f.write_text(content)
    with pytest.raises(TraceError, match=message):
        traces.load(fmt, f)


def test_shared_prefix_hot_share():
    w = workloads.from_spec({"type": "synthetic", "prompt_tokens": 100, "output_tokens": 8,
                             "shared_prefix": {"groups": 10, "prefix_tokens": 40, "hot_share": 0.8}})
    kinds = [s.kind for s in _take(w, 1000)]
    assert 0.78 < kinds.count("prefix-0") / 1000 < 0.88  # 0.8 hot + 0.2 x 1/10 uniform
    with pytest.raises(workloads.WorkloadError, match="hot_share"):
        workloads.from_spec({"type": "synthetic", "shared_prefix": {"groups": 2, "prefix_tokens": 8, "hot_share": 2}})
