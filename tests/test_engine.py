"""Engine tests with a model-free runner: stops, text, n > 1, abort, bad input, pipelining."""
from __future__ import annotations

import random

import pytest

from engine_fakes import (ALLOCATORS, ByteTokenizer, CharTokenizer,
                          FakeSlotAllocator, KVFakeRunner, PipelinedFakeExecutor, fake_info,
                          reference)

from orca_ext.chat import ChatTemplate
from orca_ext.detokenizer import Detokenizer
from orca_ext.engine import Engine, PromptError
from orca_ext.sampling_params import SamplingParams
from orca_ext.scheduler import SchedulerConfig, make_scheduler

TOK = CharTokenizer()
VOCAB = TOK.vocab
EOS = 94  # "~"


@pytest.fixture(params=ALLOCATORS)
def allocator_cls(request):
    return request.param()


def make_engine(policy="orca", allocator_cls=FakeSlotAllocator, num_blocks=128, block_size=4,
                max_batch_size=8, in_flight=1, budget=None, max_model_len=256, tokenizer=TOK,
                eos=(EOS,)) -> Engine:
    allocator = allocator_cls(num_blocks, block_size)
    runner = KVFakeRunner(allocator, VOCAB)
    executor = runner if in_flight == 1 else PipelinedFakeExecutor(runner)
    config = SchedulerConfig(policy, max_batch_size, in_flight, budget)
    return Engine(executor, make_scheduler(config, allocator),
                  fake_info(max_model_len, VOCAB, tokenizer, eos))


def run(engine: Engine) -> dict:
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def prompt_ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB - 1) for _ in range(length)]


@pytest.mark.parametrize("policy,budget", [("orca", None), ("paged", None), ("paged", 8),
                                           ("request", None)])
@pytest.mark.parametrize("max_batch_size", [1, 3, 16])
@pytest.mark.parametrize("arrival", ["at_once", "staggered"])
@pytest.mark.parametrize("in_flight", [1, 2])
def test_same_greedy_outputs_whatever_the_schedule(policy, budget, max_batch_size, arrival,
                                                   in_flight):
    engine = make_engine(policy, num_blocks=40, max_batch_size=max_batch_size,
                         in_flight=in_flight, budget=budget)
    rng = random.Random(0)
    requests = {f"r{i}": (prompt_ids(i, rng.randint(1, 30)), rng.randint(1, 40))
                for i in range(12)}
    finished = {}
    for request_id, (prompt, max_tokens) in requests.items():
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens))
        if arrival == "staggered":
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
    finished.update(run(engine))
    assert finished.keys() == requests.keys()
    for request_id, (prompt, max_tokens) in requests.items():
        out = finished[request_id]
        expected = reference(prompt, max_tokens, VOCAB, stop_ids={EOS})
        completion = out.outputs[0]
        assert out.prompt_token_ids == prompt and out.prompt is None
        assert completion.token_ids == expected
        stopped = expected[-1] == EOS
        assert completion.finish_reason == ("stop" if stopped else "length")
        assert completion.stop_reason == (EOS if stopped else None)
        assert completion.text == TOK.decode(expected[:-1] if stopped else expected)
    assert engine.scheduler.allocator.num_used_blocks == 0
    assert engine.stats().num_requests == 0


def test_real_allocator_end_to_end(allocator_cls):
    engine = make_engine("paged", allocator_cls, num_blocks=12, max_batch_size=4)
    for i in range(6):
        engine.add_request(str(i), prompt_ids(i, 10), SamplingParams(max_tokens=30,
                                                                     ignore_eos=True))
    finished = run(engine)
    for i in range(6):
        assert finished[str(i)].outputs[0].token_ids == reference(prompt_ids(i, 10), 30, VOCAB)
    assert engine.stats().num_preemptions > 0
    assert engine.scheduler.allocator.num_used_blocks == 0


def test_finished_request_returns_and_frees_kv_at_its_iteration():
    engine = make_engine("orca", block_size=1)
    engine.add_request("long", prompt_ids(1, 5), SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("short", prompt_ids(2, 5), SamplingParams(max_tokens=3, ignore_eos=True))
    steps = [engine.step() for _ in range(3)]
    assert [o.request_id for o in steps[2] if o.finished] == ["short"]
    assert [len(o.outputs[0].token_ids) for o in steps[2] if o.request_id == "short"] == [3]
    assert engine.scheduler.allocator.num_used_blocks == 5 + 30  # only "long" reserves now
    assert engine.stats().num_requests == 1


def test_request_level_batch_runs_as_a_unit():
    """FasterTransformer-style request-level batching: a finished request keeps its row (its last
    token recomputed at the same position) and its KV until the batch drains, and is returned
    only then; the next batch starts after that."""
    engine = make_engine("request", block_size=1)
    engine.add_request("long", prompt_ids(1, 5), SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("short", prompt_ids(2, 5), SamplingParams(max_tokens=3, ignore_eos=True))
    steps = [engine.step() for _ in range(3)]
    assert steps == [[], [], []]  # nothing streams, and "short" (done now) is held
    assert engine.scheduler.allocator.num_used_blocks == (5 + 30) + (5 + 3)
    engine.add_request("late", prompt_ids(3, 5), SamplingParams(max_tokens=2, ignore_eos=True))
    returned = {}
    while "long" not in returned:
        returned = {out.request_id: out for out in engine.step()}
    assert sorted(returned) == ["long", "short"]  # in the same step
    assert returned["short"].outputs[0].token_ids == reference(prompt_ids(2, 5), 3, VOCAB)
    assert returned["long"].outputs[0].token_ids == reference(prompt_ids(1, 5), 30, VOCAB)
    short_id = 1  # internal ids follow arrival
    rows = [r for b in engine.executor.batches for r in b.requests if r.request_id == short_id]
    assert len(rows) == 30  # one per iteration of the batch: prompt, 2 decodes, 27 held rows
    short_tokens = reference(prompt_ids(2, 5), 3, VOCAB)
    assert all((r.token_ids, r.num_computed) == ([short_tokens[-1]], 7) for r in rows[3:])
    late = run(engine)["late"]
    assert late.outputs[0].token_ids == reference(prompt_ids(3, 5), 2, VOCAB)
    assert engine.scheduler.allocator.num_used_blocks == 0


def test_request_level_pads_prompts_to_the_longest():
    """Padding runs after a short prompt (its KV overwritten later, its outputs dropped) and is
    reserved for: max(longest prompt, prompt + max_tokens) slots each; outputs are unchanged."""
    engine = make_engine("request", block_size=1)
    engine.add_request("short", prompt_ids(1, 3), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request("long", prompt_ids(2, 9), SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.step() == [] and engine.step() == []
    prompts, decodes = (b.requests for b in engine.executor.batches)
    assert [(len(r.token_ids), r.num_padding) for r in prompts] == [(3, 6), (9, 0)]
    assert [(len(r.token_ids), r.num_padding) for r in decodes] == [(1, 0), (1, 0)]
    assert engine.scheduler.allocator.num_used_blocks == 9 + (9 + 2)
    finished = run(engine)
    assert finished["short"].outputs[0].token_ids == reference(prompt_ids(1, 3), 4, VOCAB)
    assert finished["long"].outputs[0].token_ids == reference(prompt_ids(2, 9), 2, VOCAB)
    assert engine.scheduler.allocator.num_used_blocks == 0


def test_request_level_abort_of_the_last_running_request_releases_the_held_ones():
    engine = make_engine("request", block_size=1)
    engine.add_request("long", prompt_ids(1, 5), SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("short", prompt_ids(2, 5), SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.step() == [] and engine.step() == []
    assert engine.abort("long").outputs[0].finish_reason == "abort"
    (short,) = engine.step()
    assert short.request_id == "short" and short.outputs[0].finish_reason == "length"
    assert not engine.has_unfinished()
    assert engine.scheduler.allocator.num_used_blocks == 0


def test_stop_strings_truncate_text_and_stream_safely():
    prompt = prompt_ids(3, 8)
    full = reference(prompt, 40, VOCAB)
    text = TOK.decode(full)
    stop = text[10:13]  # spans three tokens
    cut = text.find(stop)
    engine = make_engine()
    engine.add_request("s", prompt, SamplingParams(max_tokens=40, ignore_eos=True,
                                                   stop=["never", stop]))
    streamed = []
    while engine.has_unfinished():
        streamed += [o.outputs[0] for o in engine.step()]
    final = streamed[-1]
    assert final.text == text[:cut]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.token_ids == full[:cut + len(stop)]  # tokens are kept up to the stop string
    assert all(final.text.startswith(o.text) for o in streamed)  # never a partial stop string
    assert engine.scheduler.allocator.num_used_blocks == 0


def test_stop_string_on_the_last_allowed_token_wins_over_length():
    prompt = prompt_ids(4, 6)
    full = reference(prompt, 6, VOCAB)
    stop = TOK.decode(full[-2:])
    engine = make_engine()
    engine.add_request("s", prompt, SamplingParams(max_tokens=6, ignore_eos=True, stop=stop))
    assert TOK.decode(full).find(stop) == len(full) - 2  # the stop string first shows up last
    out = run(engine)["s"].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop, TOK.decode(full[:-2]))


def test_stop_token_ids_and_ignore_eos():
    prompt = prompt_ids(5, 6)
    full = reference(prompt, 30, VOCAB)
    token = full[5]
    first = full.index(token)
    engine = make_engine(eos=(token,))
    engine.add_request("eos", prompt, SamplingParams(max_tokens=30))
    engine.add_request("ignore", prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("stop_id", prompt, SamplingParams(max_tokens=30, ignore_eos=True,
                                                         stop_token_ids=[token]))
    finished = run(engine)
    for request_id in ("eos", "stop_id"):
        out = finished[request_id].outputs[0]
        assert out.token_ids == full[:first + 1]
        assert (out.finish_reason, out.stop_reason) == ("stop", token)
        assert out.text == TOK.decode(full[:first])  # the stop token is not in the text
    assert finished["ignore"].outputs[0].token_ids == full
    assert finished["ignore"].outputs[0].finish_reason == "length"


def test_context_length_limit():
    """vLLM's rule: ``max_tokens=None`` runs up to the context, and a prompt plus an explicit
    ``max_tokens`` over it is refused naming both numbers (no silent capping)."""
    engine = make_engine(max_model_len=20)
    engine.add_request("a", prompt_ids(6, 15), SamplingParams(max_tokens=None, ignore_eos=True))
    engine.add_request("b", prompt_ids(7, 19), SamplingParams(max_tokens=None, ignore_eos=True))
    engine.add_request("c", prompt_ids(8, 15), SamplingParams(max_tokens=5, ignore_eos=True))
    finished = run(engine)
    assert [len(finished[r].outputs[0].token_ids) for r in "abc"] == [5, 1, 5]
    assert {o.outputs[0].finish_reason for o in finished.values()} == {"length"}
    with pytest.raises(PromptError, match=r"maximum context length is 20 tokens\. However, you "
                       r"requested 21 tokens \(15 in the prompt, 6 for the completion\)") as error:
        engine.add_request("d", prompt_ids(8, 15), SamplingParams(max_tokens=6))
    assert (error.value.param, error.value.code) == ("max_tokens", "context_length_exceeded")
    with pytest.raises(PromptError, match=r"the prompt \(20 tokens\) fills the model's context "
                       r"\(20 tokens\): no room to generate"):
        engine.add_request("e", prompt_ids(8, 20), SamplingParams(max_tokens=None))
    with pytest.raises(PromptError, match="the prompt has 21 tokens"):
        engine.add_request("f", prompt_ids(8, 21))
    assert not engine.has_unfinished()


def test_prepare_is_the_one_entrance():
    """``prepare`` turns text, token ids or chat messages with their params into token ids and
    a max-new-tokens, checked against the context and the whole KV cache; ``add_request``
    takes what it gives as it is."""
    engine = make_engine(num_blocks=16, block_size=4, max_model_len=48)  # 64 KV slots
    text = engine.prepare("hi", SamplingParams(max_tokens=None))
    assert (text.text, text.token_ids, text.max_new_tokens) == ("hi", TOK.encode("hi"), 46)
    ids = engine.prepare([1, 2, 3], SamplingParams(max_tokens=4))
    assert (ids.text, ids.token_ids, ids.max_new_tokens) == (None, [1, 2, 3], 4)
    template = ChatTemplate("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    chat = engine.prepare([{"role": "user", "content": "yo"}], SamplingParams(max_tokens=2),
                          chat_template=template)
    assert chat.token_ids == TOK.encode("<yo>") and chat.max_new_tokens == 2
    with pytest.raises(PromptError, match="no chat template") as error:
        engine.prepare([{"role": "user", "content": "yo"}])  # the model has none
    assert (error.value.param, error.value.code) == ("messages", "no_chat_template")
    with pytest.raises(PromptError, match=r"the messages, 40 for the completion\)\. Reduce "
                       "the messages or max_completion_tokens") as error:
        engine.prepare([{"role": "user", "content": "y" * 10}], SamplingParams(max_tokens=40),
                       chat_template=template, max_tokens_param="max_completion_tokens")
    assert error.value.param == "max_completion_tokens"
    small = make_engine(num_blocks=4, block_size=4, max_model_len=48)  # 16 KV slots
    with pytest.raises(PromptError, match=r"exceeds the whole KV cache \(16 tokens\)") as error:
        small.prepare([1] * 10, SamplingParams(max_tokens=None))
    assert error.value.param == "max_tokens"
    engine.add_request("ids", ids)
    with pytest.raises(ValueError, match="params: a prepared prompt carries its own"):
        engine.add_request("again", ids, SamplingParams())
    out = run(engine)["ids"].outputs[0]
    assert out.token_ids == reference([1, 2, 3], 4, VOCAB, stop_ids=(EOS,))


def test_bad_input_raises_and_engine_keeps_running():
    engine = make_engine(num_blocks=16, block_size=4)  # 64 slots
    engine.add_request("ok", prompt_ids(9, 5), SamplingParams(max_tokens=10, ignore_eos=True))
    engine.step()
    mutated = SamplingParams()
    mutated.temperature = -1.0
    huge_seed = SamplingParams(n=2)
    huge_seed.seed = 2**63 - 1  # seed + 1 for the second sample would overflow torch's seeds
    bad = [("", None, "prompt"), ([], None, "prompt"), ([1, 2, VOCAB], None, "prompt"),
           ([-1], None, "prompt"), ([1.5], None, "prompt"), ("x" * 300, None, "prompt"),
           ([1] * 30, SamplingParams(max_tokens=40), "max_tokens"),
           ([1], mutated, "temperature"), ([1], huge_seed, "seed"), ("ok", None, "request_id")]
    for prompt, params, field in bad:
        with pytest.raises(ValueError, match=field):
            engine.add_request("ok" if field == "request_id" else "bad", prompt, params)
    with pytest.raises(ValueError, match="stop"):
        make_engine(tokenizer=None).add_request("x", [1], SamplingParams(stop=["a"]))
    with pytest.raises(ValueError, match="tokenizer"):
        make_engine(tokenizer=None).add_request("x", "text")
    assert engine.stats().num_requests == 1 and engine.stats().num_waiting == 0
    out = run(engine)["ok"].outputs[0]
    assert out.token_ids == reference(prompt_ids(9, 5), 10, VOCAB)


def test_n_samples_merge_into_one_output():
    prompt = prompt_ids(10, 7)
    engine = make_engine()
    engine.add_request("n", prompt, SamplingParams(n=3, seed=5, max_tokens=12, ignore_eos=True))
    engine.add_request("m", prompt, SamplingParams(n=2, max_tokens=4 + 1, ignore_eos=True))
    assert engine.stats().num_requests == 2 and engine.stats().num_waiting == 5
    finished = run(engine)
    out = finished["n"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, c in enumerate(out.outputs):
        assert c.token_ids == reference(prompt, 12, VOCAB, seed=5 + i)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert finished["m"].outputs[0].token_ids == finished["m"].outputs[1].token_ids


def test_n_samples_finish_together():
    engine = make_engine(eos=())
    prompt = prompt_ids(11, 4)
    stop_token = reference(prompt, 3, VOCAB, seed=1)[2]  # only sample 1 stops early
    engine.add_request("n", prompt, SamplingParams(n=2, seed=0, max_tokens=20,
                                                   stop_token_ids=[stop_token]))
    seen = []
    while engine.has_unfinished():
        seen += engine.step()
    assert [o.finished for o in seen].count(True) == 1 and seen[-1].finished
    reasons = [c.finish_reason for c in seen[-1].outputs]
    assert "stop" in reasons


def test_abort():
    engine = make_engine()
    engine.add_request("a", prompt_ids(12, 5), SamplingParams(n=2, max_tokens=50,
                                                              ignore_eos=True))
    engine.add_request("b", prompt_ids(13, 5), SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    engine.step()
    out = engine.abort("a")
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    assert len(out.outputs[0].token_ids) == 2
    assert engine.abort("a") is None and engine.abort("nope") is None
    finished = run(engine)
    assert list(finished) == ["b"]
    assert engine.scheduler.allocator.num_used_blocks == 0


def test_abort_while_in_flight_pipelined():
    engine = make_engine(in_flight=2, max_batch_size=1)
    for i in range(3):
        engine.add_request(str(i), prompt_ids(i, 4), SamplingParams(max_tokens=20,
                                                                    ignore_eos=True))
    engine.step()  # two batches out, one back
    assert engine.scheduler.num_batches_in_flight == 1
    for i in range(3):
        engine.abort(str(i))
    assert engine.has_unfinished()  # the batch in flight must still come back
    run(engine)
    assert engine.scheduler.allocator.num_used_blocks == 0
    assert not engine.has_unfinished()


def test_pipelining_needs_submit_collect():
    allocator = FakeSlotAllocator(8, 4)
    with pytest.raises(ValueError, match="submit"):
        Engine(KVFakeRunner(allocator), make_scheduler(SchedulerConfig(num_batches_in_flight=2),
                                                       allocator), fake_info(32))


def test_logprobs_metrics_and_final_only():
    engine = make_engine()
    engine.add_request("lp", prompt_ids(14, 3), SamplingParams(max_tokens=4, ignore_eos=True,
                                                               logprobs=2), stream=False)
    engine.add_request("plain", prompt_ids(15, 3), SamplingParams(max_tokens=4, ignore_eos=True),
                       stream=False)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert all(o.finished for o in outputs) and len(outputs) == 2
    lp = next(o for o in outputs if o.request_id == "lp")
    c = lp.outputs[0]
    assert len(c.logprobs) == 4 and c.cumulative_logprob == pytest.approx(-1.0)
    for token, entry in zip(c.token_ids, c.logprobs):
        assert entry[token] == -0.25 and len(entry) == 2
    plain = next(o for o in outputs if o.request_id == "plain").outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None
    m = lp.metrics
    assert m.arrival_time <= m.first_token_time <= m.finish_time
    stats = engine.stats()
    assert stats.num_generated_tokens == 8 and stats.kv_usage == 0


def test_detokenizer_multibyte_and_stop():
    tok = ByteTokenizer()
    text = "héllo wörld — 日本語 ✓ done"
    ids = tok.encode(text)
    detok = Detokenizer(tok, tok.encode("prompt "), [])
    shown = []
    for token in ids:
        assert detok.append(token) is None
        shown.append(detok.output_text(False))
    assert detok.text == text
    assert all("\ufffd" not in s and text.startswith(s) for s in shown)
    detok = Detokenizer(tok, [65], ["日本", "zzz"])
    hit = None
    for token in ids:
        hit = detok.append(token)
        assert text.startswith(detok.output_text(False))
        if hit:
            break
    assert hit == "日本" and detok.text == "héllo wörld — "


def test_detokenizer_flushes_an_incomplete_character_at_the_end():
    tok = ByteTokenizer()
    detok = Detokenizer(tok, [65], [])
    for token in [104, 0xC3]:  # "h", then half of a two-byte character
        detok.append(token)
    assert detok.output_text(False) == "h"
    assert detok.flush() is None and detok.text == tok.decode([104, 0xC3]) == "h\ufffd"
