"""Workloads built with the real embedded SmolLM2 tokenizer: exact prompt lengths, ranges,
mixes, shared prefixes, ShareGPT filtering, trace parsing."""
from __future__ import annotations

import json
import os

import pytest

from sloserve.bench.datasets import (PromptFactory, copy_workload, mixed_workload, random_workload,
                                     shared_prefix_workload, sharegpt_workload, trace_workload)


def ntok(tok, text):
    return len(tok.encode(text, add_special_tokens=False))


# --- PromptFactory ----------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 7, 128, 1000])
def test_prompt_factory_exact_length(factory, bench_tokenizer, n):
    for _ in range(3):
        text, got = factory.make(n)
        assert got == n
        assert ntok(bench_tokenizer, text) == n
        assert factory.count(text) == n


def test_prompt_factory_is_seeded(bench_tokenizer, make_factory):
    a = PromptFactory(bench_tokenizer, seed=3)
    b = PromptFactory(bench_tokenizer, seed=3)
    c = make_factory(4)
    ta, tb, tc = a.make(50)[0], b.make(50)[0], c.make(50)[0]
    assert ta == tb and ta != tc
    assert a.make(50)[0] != ta  # the factory's generator moves on
    # the make_factory fixture is equivalent to constructing one
    assert make_factory(3).make(50)[0] == ta


@pytest.mark.parametrize("n", [0, -3])
def test_prompt_factory_rejects_empty(factory, n):
    with pytest.raises(ValueError, match=">= 1"):
        factory.make(n)


def test_prompt_factory_needs_word_tokens():
    class Tiny:
        def __len__(self):
            return 3

        def encode(self, text, add_special_tokens=True):
            return [0]

        def decode(self, ids, skip_special_tokens=True):
            return " ab"

    with pytest.raises(ValueError, match="whole-word tokens"):
        PromptFactory(Tiny())


# --- random -------------------------------------------------------------------------------------

def test_random_workload_lengths_in_range(factory, bench_tokenizer):
    reqs = random_workload(factory, 40, 100, 20, range_ratio=0.25, seed=1)
    assert len(reqs) == 40
    ins = [r.prompt_len for r in reqs]
    outs = [r.expected_output_len for r in reqs]
    assert all(75 <= i <= 125 for i in ins) and all(15 <= o <= 25 for o in outs)
    assert len(set(ins)) > 10 and len(set(outs)) > 5  # actually spread
    assert all(ntok(bench_tokenizer, r.prompt) == r.prompt_len for r in reqs)
    assert all(r.arrival_time is None and r.tag is None for r in reqs)


def test_random_workload_without_range_is_exact(factory):
    reqs = random_workload(factory, 5, 33, 7, range_ratio=0.0)
    assert [(r.prompt_len, r.expected_output_len) for r in reqs] == [(33, 7)] * 5


def test_random_prefix_is_shared_and_counted(factory, bench_tokenizer):
    """--random-prefix-len: every prompt starts with the same prefix_len tokens, and its length
    is prefix + drawn length (exactly, here: word tokens keep their boundaries)."""
    reqs = random_workload(factory, 6, 20, 5, range_ratio=0.5, seed=3, prefix_len=48)
    ids = [bench_tokenizer.encode(r.prompt, add_special_tokens=False) for r in reqs]
    assert len({tuple(i[:48]) for i in ids}) == 1
    assert len({tuple(i[48:]) for i in ids}) == 6  # the rest differs
    assert all(len(i) == r.prompt_len and 58 <= r.prompt_len <= 78 for i, r in zip(ids, reqs))
    with pytest.raises(ValueError, match="prefix length"):
        random_workload(factory, 1, 20, 5, prefix_len=-1)


def test_random_workload_reproducible(make_factory):
    def build(factory_seed, seed):
        return random_workload(make_factory(factory_seed), 8, 40, 10,
                               range_ratio=0.5, seed=seed)

    a, b, c = build(0, 5), build(0, 5), build(0, 6)
    assert [(r.prompt, r.prompt_len, r.expected_output_len) for r in a] == \
           [(r.prompt, r.prompt_len, r.expected_output_len) for r in b]
    assert [(r.prompt_len, r.expected_output_len) for r in a] != \
           [(r.prompt_len, r.expected_output_len) for r in c]


@pytest.mark.parametrize("kwargs", [dict(range_ratio=1.0), dict(range_ratio=-0.1),
                                    dict(input_len=0), dict(output_len=0)])
def test_random_workload_bad_args(factory, kwargs):
    args = dict(num_prompts=2, input_len=10, output_len=10, range_ratio=0.0) | kwargs
    with pytest.raises(ValueError):
        random_workload(factory, **args)


# --- mixed --------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [7, 25, 50])
def test_mixed_workload(factory, bench_tokenizer, n):
    reqs = mixed_workload(factory, n, short_lens=(16, 32, 48), long_lens=(256, 512),
                          long_fraction=0.2, output_range=(3, 9), scale=0.5, seed=2)
    assert len(reqs) == n
    long_ = [r for r in reqs if r.tag == "long"]
    short = [r for r in reqs if r.tag == "short"]
    assert len(long_) == round(0.2 * n) and len(short) == n - round(0.2 * n)
    assert all(r.prompt_len in (128, 256) for r in long_)
    assert all(r.prompt_len in (8, 16, 24) for r in short)
    assert all(3 <= r.expected_output_len <= 9 for r in reqs)
    assert all(ntok(bench_tokenizer, r.prompt) == r.prompt_len for r in reqs)


def test_mixed_workload_spread_and_reproducible(make_factory):
    def build(seed):
        return mixed_workload(make_factory(0), 40, short_lens=(10, 20), long_lens=(60, 80),
                              output_range=(1, 4), seed=seed)

    a, b, c = build(1), build(1), build(2)
    key = lambda rs: [(r.prompt, r.prompt_len, r.expected_output_len, r.tag) for r in rs]  # noqa: E731
    assert key(a) == key(b) and key(a) != key(c)
    assert {r.prompt_len for r in a} == {10, 20, 60, 80}
    assert {r.expected_output_len for r in a} == {1, 2, 3, 4}
    tags = [r.tag for r in a]
    assert tags != sorted(tags) and tags != sorted(tags, reverse=True)  # long ones at random places


def test_mixed_workload_fraction_extremes(factory):
    assert {r.tag for r in mixed_workload(factory, 4, short_lens=(4,), long_lens=(8,),
                                          long_fraction=0.0)} == {"short"}
    assert {r.tag for r in mixed_workload(factory, 4, short_lens=(4,), long_lens=(8,),
                                          long_fraction=1.0)} == {"long"}


@pytest.mark.parametrize("kwargs", [dict(long_fraction=1.5), dict(long_fraction=-0.1), dict(scale=0.0),
                                    dict(short_lens=()), dict(long_lens=()),
                                    dict(output_range=(0, 5)), dict(output_range=(6, 5))])
def test_mixed_workload_bad_args(factory, kwargs):
    with pytest.raises(ValueError):
        mixed_workload(factory, 4, **({"short_lens": (4,), "long_lens": (8,)} | kwargs))


# --- shared prefix ------------------------------------------------------------------------------

def _common_prefix(texts):
    return os.path.commonprefix(list(texts))


def test_shared_prefix_groups_share_prefix_text(factory, bench_tokenizer):
    reqs = shared_prefix_workload(factory, 8, num_groups=3, prefix_len=64, suffix_len=8, output_len=5,
                                  seed=0)
    assert len(reqs) == 8
    groups = {}
    for r in reqs:
        groups.setdefault(r.tag, []).append(r)
    assert sorted(groups) == ["group0", "group1", "group2"]
    assert sorted(len(g) for g in groups.values()) == [2, 3, 3]
    prefixes = {}
    for tag, rs in groups.items():
        p = _common_prefix(r.prompt for r in rs)
        assert ntok(bench_tokenizer, p) >= 63  # the 64-token prefix (a boundary token may differ)
        prefixes[tag] = p
        for r in rs:
            assert r.prompt.startswith(p)
            assert ntok(bench_tokenizer, r.prompt[len(p):]) <= 10  # own suffix
    # different groups: different prefixes
    for a in prefixes:
        for b in prefixes:
            if a < b:
                assert ntok(bench_tokenizer, _common_prefix([prefixes[a], prefixes[b]]) or " ") <= 2
    assert all(r.expected_output_len == 5 for r in reqs)
    assert all(r.prompt_len == ntok(bench_tokenizer, r.prompt) for r in reqs)
    assert all(71 <= r.prompt_len <= 73 for r in reqs)
    # shuffled (seeded) so groups interleave, not in i % groups order
    assert [r.tag for r in reqs] != [f"group{i % 3}" for i in range(8)]


def test_shared_prefix_bad_groups(factory):
    with pytest.raises(ValueError):
        shared_prefix_workload(factory, 4, num_groups=0)


# --- ShareGPT -----------------------------------------------------------------------------------

def _conv(prompt, reply, key="conversations"):
    return {key: [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}]}


@pytest.fixture
def sharegpt_file(tmp_path, factory):
    t = lambda n: factory.make(n)[0]  # noqa: E731
    data = [
        _conv(t(10), t(12)),                       # kept
        _conv(t(3), t(20)),                        # prompt < 4 tokens
        _conv(t(10), t(3)),                        # output < 4 tokens
        _conv(t(1030), t(10)),                     # prompt > 1024
        _conv(t(1000), t(1100)),                   # total > 2048
        {"conversations": [{"from": "human", "value": t(10)}]},  # one turn
        _conv(t(20), t(30), key="conversation"),   # kept (other key spelling)
        "not a dict",
        {"id": "no conversations"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_sharegpt_filtering(sharegpt_file, bench_tokenizer):
    reqs = sharegpt_workload(sharegpt_file, bench_tokenizer, 2, seed=0)
    assert sorted((r.prompt_len, r.expected_output_len) for r in reqs) == [(10, 12), (20, 30)]
    assert all(ntok(bench_tokenizer, r.prompt) == r.prompt_len for r in reqs)
    with pytest.raises(ValueError, match="only 2 usable conversations, 3 requested"):
        sharegpt_workload(sharegpt_file, bench_tokenizer, 3)


def test_sharegpt_output_len_override(sharegpt_file, bench_tokenizer):
    # with a fixed output of 7 the short reply and the long total no longer disqualify
    reqs = sharegpt_workload(sharegpt_file, bench_tokenizer, 4, output_len=7)
    assert sorted(r.prompt_len for r in reqs) == [10, 10, 20, 1000]
    assert all(r.expected_output_len == 7 for r in reqs)
    with pytest.raises(ValueError, match="only 4 usable"):
        sharegpt_workload(sharegpt_file, bench_tokenizer, 5, output_len=7)


def test_sharegpt_seeded_order(sharegpt_file, bench_tokenizer):
    orders = {tuple(r.prompt_len for r in sharegpt_workload(sharegpt_file, bench_tokenizer, 4,
                                                            output_len=7, seed=s)) for s in range(8)}
    assert len(orders) > 1
    a = [r.prompt for r in sharegpt_workload(sharegpt_file, bench_tokenizer, 4, output_len=7, seed=3)]
    b = [r.prompt for r in sharegpt_workload(sharegpt_file, bench_tokenizer, 4, output_len=7, seed=3)]
    assert a == b


def test_sharegpt_not_a_list(tmp_path, bench_tokenizer):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match="expected a JSON list"):
        sharegpt_workload(str(p), bench_tokenizer, 1)


# --- trace --------------------------------------------------------------------------------------

def _write(tmp_path, lines, name="trace.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def test_trace_shifted_sorted_and_scaled(tmp_path, factory, bench_tokenizer):
    path = _write(tmp_path, [
        json.dumps({"arrival_time": 5.0, "input_len": 8, "output_len": 4}),
        json.dumps({"arrival_time": 3.0, "input_len": 12, "output_len": 6}),
        "",
        json.dumps({"arrival_time": 4.5, "input_len": 10, "output_len": 5}),
    ])
    reqs = trace_workload(path, factory)
    assert [r.arrival_time for r in reqs] == [0.0, 1.5, 2.0]
    assert [(r.prompt_len, r.expected_output_len) for r in reqs] == [(12, 6), (10, 5), (8, 4)]
    assert all(ntok(bench_tokenizer, r.prompt) == r.prompt_len for r in reqs)
    reqs = trace_workload(path, factory, 2, time_scale=2.0)
    assert [r.arrival_time for r in reqs] == [0.0, 3.0]
    assert [r.prompt_len for r in reqs] == [12, 10]


def test_trace_mooncake_fields(tmp_path, factory):
    path = _write(tmp_path, [
        json.dumps({"timestamp": 27482, "input_length": 6, "output_length": 3, "hash_ids": [1, 2]}),
        json.dumps({"timestamp": 30000, "input_length": 9, "output_length": 2, "hash_ids": [3]}),
    ])
    reqs = trace_workload(path, factory)
    assert [r.arrival_time for r in reqs] == pytest.approx([0.0, 2.518], abs=1e-9)
    assert [(r.prompt_len, r.expected_output_len) for r in reqs] == [(6, 3), (9, 2)]


@pytest.mark.parametrize("bad", [
    "not json",
    json.dumps({"arrival_time": 1.0, "output_len": 4}),               # no input length
    json.dumps({"input_len": 4, "output_len": 4}),                    # no time
    json.dumps({"arrival_time": "soon", "input_len": 4, "output_len": 4}),
    json.dumps([1.0, 4, 4]),
])
def test_trace_bad_line_names_the_line(tmp_path, factory, bad):
    good = json.dumps({"arrival_time": 0.0, "input_len": 4, "output_len": 4})
    path = _write(tmp_path, [good, "", bad, good])
    with pytest.raises(ValueError, match=r"trace\.jsonl:3: bad trace line"):
        trace_workload(path, factory)


@pytest.mark.parametrize("field", ["input_len", "output_len"])
def test_trace_non_positive_length_names_the_line(tmp_path, factory, field):
    good = json.dumps({"arrival_time": 0.0, "input_len": 4, "output_len": 4})
    bad = json.dumps({"arrival_time": 1.0, "input_len": 4, "output_len": 4} | {field: 0})
    path = _write(tmp_path, [good, bad])
    with pytest.raises(ValueError, match=r"trace\.jsonl:2"):
        trace_workload(path, factory)


# --- workload flags -----------------------------------------------------------------------------

def _parse(*argv):
    import argparse

    from sloserve.bench.workload_args import add_workload_args
    p = argparse.ArgumentParser()
    add_workload_args(p)
    return p.parse_args(list(argv))


def test_workload_flags_build_the_named_workload(factory, tmp_path):
    from sloserve.bench.workload_args import arrival_process, build_workload
    a = _parse("--dataset-name", "mixed", "--num-prompts", "10", "--mixed-short-lens", "4,6",
               "--mixed-long-lens", "20", "--mixed-long-fraction", "0.3", "--mixed-output-len-range", "2,3")
    reqs = build_workload(a, factory)
    assert [r.tag for r in reqs].count("long") == 3
    assert {r.prompt_len for r in reqs} <= {4, 6, 20} and {r.expected_output_len for r in reqs} <= {2, 3}
    a = _parse("--num-prompts", "3", "--random-input-len", "5", "--random-output-len", "2")
    assert [(r.prompt_len, r.expected_output_len) for r in build_workload(a, factory)] == [(5, 2)] * 3
    assert arrival_process(_parse()) == "poisson"
    assert arrival_process(_parse("--burstiness", "0.5")) == "gamma"
    assert arrival_process(_parse("--burstiness", "0.5", "--arrival", "constant")) == "constant"
    assert _parse("--request-rate", "inf").request_rate == float("inf")
    with pytest.raises(ValueError, match="LO,HI"):
        build_workload(_parse("--dataset-name", "mixed", "--mixed-output-len-range", "2,3,4"), factory)
    with pytest.raises(ValueError, match="needs --dataset-path"):
        build_workload(_parse("--dataset-name", "trace"), factory)
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_time": 2, "input_len": 3, "output_len": 1}\n'
                     '{"arrival_time": 3, "input_len": 4, "output_len": 1}\n')
    reqs = build_workload(_parse("--dataset-name", "trace", "--dataset-path", str(trace),
                                 "--trace-time-scale", "0.5"), factory)
    assert [r.arrival_time for r in reqs] == [0.0, 0.5]


def test_copy_workload_asks_to_repeat_or_edit_the_shipped_passages(factory):
    from sloserve.bench.copy_passages import PASSAGES
    reqs = copy_workload(factory, 12, output_extra=5, seed=3)
    used = [next(i for i, p in enumerate(PASSAGES) if p in r.prompt) for r in reqs]
    assert sorted(used[:10]) == list(range(10))  # every passage once before one repeats
    for r, i in zip(reqs, used):
        assert r.expected_output_len == factory.count(PASSAGES[i]) + 5
        assert r.prompt_len == factory.count(r.prompt) and r.tag == "copy"
    assert [r.prompt for r in copy_workload(factory, 12, output_extra=5, seed=3)] == \
        [r.prompt for r in reqs]


def test_trace_priorities_are_read_and_checked(tmp_path, factory):
    path = _write(tmp_path, [
        json.dumps({"arrival_time": 0.5, "input_len": 4, "output_len": 2, "priority": 3}),
        json.dumps({"arrival_time": 0.0, "input_len": 5, "output_len": 2}),
    ])
    assert [r.priority for r in trace_workload(path, factory)] == [0, 3]
    path = _write(tmp_path, [json.dumps({"arrival_time": 0.0, "input_len": 4, "output_len": 2,
                                         "priority": "high"})])
    with pytest.raises(ValueError, match=r"priority must be an integer in .*, got 'high'"):
        trace_workload(path, factory)
    path = _write(tmp_path, [json.dumps({"arrival_time": 0.0, "input_len": 4, "output_len": 2,
                                         "priority": 10**30})])
    with pytest.raises(ValueError, match=r"in \[-2\*\*63, 2\*\*63\)"):
        trace_workload(path, factory)
