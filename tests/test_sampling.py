"""The batched sampler: greedy, filters, penalties, seeds and logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from orca_ext import _C
from orca_ext.runner.inputs import RequestState
from orca_ext.sampling import Sampler, apply_penalties, filter_logits
from orca_ext.sampling_params import SamplingParams


def request(request_id: int, prompt: list[int] | None = None, output: list[int] | None = None,
            **params) -> RequestState:
    """A runner's state of a request about to be sampled."""
    prompt = prompt or [0]
    return RequestState(request_id, len(prompt), SamplingParams(**params), [0],
                        prompt + (output or []))


def frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def test_greedy_rows_are_exact_argmax_in_a_mixed_batch():
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    requests = [request(i, temperature=0.0 if i % 2 else 1.3, top_k=5 * (i % 3))
                for i in range(64)]
    out = Sampler()(logits, requests)
    argmax = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in range(1, 64, 2)] == argmax[1::2]
    assert all(0 <= t < 1000 for t in out.token_ids)


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}])
def test_all_greedy_batch_is_exact_argmax(extra):
    # All greedy without penalties or logprobs takes the sampler's one-argmax path; with
    # logprobs, the general one: the same tokens.
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(1))
    out = Sampler()(logits, [request(i, temperature=0.0, **extra) for i in range(8)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert (out.logprobs[0] is None) == ("logprobs" not in extra)


@pytest.mark.parametrize("rows,vocab", [(1, 1), (1, 257), (4, 257), (33, 1000), (3, 50304),
                                       (32, 8200)])
def test_argmax_rows_matches_torch_argmax(rows, vocab):
    """The CPU greedy path's C++ argmax against torch.argmax: ties (the first wins), NaN (the
    first NaN wins), infinities, and a non-contiguous view."""
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=gen).round(decimals=1)  # rounding makes ties
    cases = [logits, torch.full((rows, vocab), float("-inf")), torch.zeros(rows, vocab)]
    special = logits.clone()
    idx = torch.randint(0, vocab, (rows, 3), generator=gen)
    special.scatter_(1, idx[:, :1], float("inf"))
    special[::2].scatter_(1, idx[::2, 1:], float("nan"))
    cases.append(special)
    cases.append(torch.randn(vocab, rows, generator=gen).t())
    # Signed zeros (equal: the first wins) and a row's maximum in its last element.
    zeros = torch.zeros(rows, vocab)
    zeros[:, ::3] = -0.0
    cases.append(zeros)
    tail = logits.clone()
    tail[:, -1] = 100.0
    cases.append(tail)
    for case in cases:
        assert _C.argmax_rows(case) == case.argmax(dim=-1).tolist()


@pytest.mark.parametrize("bad,message", [
    (torch.zeros(4), "expected float32 CPU logits"),
    (torch.zeros(2, 3, dtype=torch.float64), "expected float32 CPU logits"),
    (torch.zeros(2, 0), "logits have no columns"),
])
def test_argmax_rows_rejects_bad_logits(bad, message):
    with pytest.raises(RuntimeError, match=message):
        _C.argmax_rows(bad)


def test_temperature_sampling_follows_the_distribution():
    torch.manual_seed(0)
    base = torch.tensor([1.0, 0.5, 0.0, -1.0, 2.0])
    rows = 20000
    out = Sampler()(base.expand(rows, -1), [request(i, temperature=0.7) for i in range(rows)])
    expected = (base / 0.7).softmax(-1).double()
    torch.testing.assert_close(frequencies(out.token_ids, 5), expected, atol=0.015, rtol=0)


def test_filter_logits_top_k_top_p_min_p():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 4).log_softmax(-1)
    probs = logits.exp()[0]  # ~ [0.636, 0.234, 0.086, 0.032, 0.012]
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.8), SamplingParams(min_p=0.1),
              SamplingParams()]
    kept = filter_logits(logits, params).isfinite()
    assert kept[0].tolist() == [True, True, False, False, False]
    assert kept[1].tolist() == [True, True, False, False, False]  # 0.636 < 0.8 <= 0.870
    assert kept[2].tolist() == (probs >= 0.1 * probs[0]).tolist()
    assert kept[3].all()
    # top_k then top_p on the renormalized top-k mass.
    both = filter_logits(logits[:1], [SamplingParams(top_k=3, top_p=0.7)]).isfinite()
    assert both[0].tolist() == [True, True, False, False, False]


@pytest.mark.parametrize("params", [dict(top_k=3), dict(top_p=0.5), dict(min_p=0.3)])
def test_sampled_tokens_stay_in_the_filtered_set(params):
    torch.manual_seed(1)
    logits = torch.randn(1, 50).expand(3000, -1)
    out = Sampler()(logits, [request(i, temperature=1.5, **params) for i in range(3000)])
    allowed = filter_logits(logits[:1] / 1.5, [SamplingParams(**params)])[0].isfinite()
    sampled = set(out.token_ids)
    assert all(allowed[t] for t in sampled) and len(sampled) > 1


def test_penalties_match_the_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    req = request(0, prompt=[0, 1], output=[3, 3, 4], repetition_penalty=2.0,
                  presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [req])
    seen = {0, 1, 3, 4}
    counts = {3: 2, 4: 1}
    expected = []
    for t, x in enumerate(logits[0].tolist()):
        if t in seen:
            x = x / 2.0 if x > 0 else x * 2.0
        if t in counts:
            x -= 0.25 * counts[t] + 0.5
        expected.append(x)
    torch.testing.assert_close(out[0], torch.tensor(expected))
    # A row without penalties is untouched, next to one with them.
    both = apply_penalties(logits.expand(2, -1), [request(1, prompt=[0, 1], output=[3]), req])
    torch.testing.assert_close(both, torch.cat([logits, out]))


def test_greedy_with_repetition_penalty_avoids_repeats():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    out = Sampler()(logits, [request(0, prompt=[0], temperature=0.0, repetition_penalty=2.0)])
    assert out.token_ids == [1]


def stream(sampler: Sampler, request_id: int, seed: int, steps: int, neighbors: int,
           logits: torch.Tensor, start: list[int] | None = None) -> list[int]:
    """Sample ``steps`` tokens for one seeded request placed among ``neighbors`` others."""
    output = list(start or [])
    for _ in range(steps):
        others = [request(100 + j, temperature=1.0) for j in range(neighbors)]
        row = neighbors // 2
        batch = others[:row] + [request(request_id, output=output, seed=seed)] + others[row:]
        tokens = sampler(logits.expand(len(batch), -1), batch).token_ids
        output.append(tokens[row])
    return output


def test_seeded_stream_does_not_depend_on_batch_composition():
    logits = torch.zeros(1, 1000)
    alone = stream(Sampler(), 7, seed=1234, steps=12, neighbors=0, logits=logits)
    crowded = stream(Sampler(), 8, seed=1234, steps=12, neighbors=5, logits=logits)
    assert alone == crowded
    assert stream(Sampler(), 7, seed=99, steps=12, neighbors=0, logits=logits) != alone


def test_seeded_stream_resumes_after_drop():
    logits = torch.zeros(1, 1000)
    full = stream(Sampler(), 3, seed=5, steps=10, neighbors=2, logits=logits)
    sampler = Sampler()
    first = stream(sampler, 3, seed=5, steps=4, neighbors=2, logits=logits)
    sampler.drop([3])  # e.g. preempted: a new generator must pick up where the old one was
    assert stream(sampler, 3, seed=5, steps=6, neighbors=1, logits=logits, start=first) == full


def test_logprobs_of_the_sampled_token_and_top_n():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    out = Sampler()(logits, [request(0, temperature=0.0, logprobs=3),
                             request(1, temperature=0.0),
                             request(2, temperature=1.0, logprobs=0)])
    logprobs = logits.log_softmax(-1)
    first = out.logprobs[0]
    assert math.isclose(first.logprob, logprobs[0, out.token_ids[0]].item(), abs_tol=1e-6)
    top_values, top_ids = logprobs[0].topk(3)
    assert list(first.top) == top_ids.tolist()
    assert list(first.top.values()) == pytest.approx(top_values.tolist(), abs=1e-6)
    assert out.logprobs[1] is None
    assert out.logprobs[2].top == {}
    assert math.isclose(out.logprobs[2].logprob, logprobs[2, out.token_ids[2]].item(),
                        abs_tol=1e-6)
