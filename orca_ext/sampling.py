"""Batched sampling over the packed requests' logits.

Per row, in Hugging Face's order: repetition / presence / frequency penalties, then greedy
(exact argmax) or temperature -> top_k -> top_p -> min_p -> a draw. Each seeded request has its
own ``torch.Generator``, seeded once and consuming one ``vocab``-sized draw per sampled token, so
its stream does not depend on which requests share the batch. Logprobs are those of the model's
distribution (``log_softmax`` of the raw logits, before penalties and temperature). Constrained
requests' rows are masked first (``token_bitmask``: tokens their grammar does not allow get
-inf), in place, by one ``apply_token_bitmask`` call; the other rows are not touched.
``Sampler.verify`` samples the rows of speculative proposals and accepts them (``spec_decode``).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from . import _C
from .batch import RunnerOutput, TokenLogprobs
from .ops import apply_token_bitmask
from .sampling_params import SamplingParams
from .structured import TokenBitmask


class SampledRequest(Protocol):
    """What the sampler reads of a request (the runner's ``RequestState``)."""

    request_id: int
    sampling_params: SamplingParams

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...


class VerifiedRequest(SampledRequest, Protocol):
    """A sampled request that may carry proposals to verify (the runner's ``RequestState``)."""

    num_spec_tokens: int

    @property
    def spec_token_ids(self) -> list[int]: ...


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0


def _token_table(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Ragged token lists as one ``[S, max_len]`` int64 tensor padded with ``pad``."""
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([[*r, *[pad] * (width - len(r))] for r in rows], dtype=torch.int64,
                        device=device).view(len(rows), width)


def apply_penalties(logits: torch.Tensor, requests: Sequence[SampledRequest]) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (HF/vLLM: positive logits divided, negative
    multiplied); presence and frequency penalties over output tokens (OpenAI)."""
    num_rows, vocab = logits.shape
    params = [r.sampling_params for r in requests]
    active = [_has_penalty(p) for p in params]
    seen_lists = [r.prompt_token_ids + r.output_token_ids if on else []
                  for r, on in zip(requests, active)]
    out_lists = [r.output_token_ids if on else [] for r, on in zip(requests, active)]
    # Column ``vocab`` absorbs the padding.
    seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, _token_table(seen_lists, vocab, logits.device), True)
    counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=logits.device)
    out_table = _token_table(out_lists, vocab, logits.device)
    counts.scatter_add_(1, out_table, torch.ones_like(out_table, dtype=logits.dtype))
    seen, counts = seen[:, :vocab], counts[:, :vocab]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=logits.device)[:, None]

    rep = column([p.repetition_penalty for p in params])
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return (logits - column([p.frequency_penalty for p in params]) * counts
            - column([p.presence_penalty for p in params]) * (counts > 0))


def apply_bias_and_min_tokens(logits: torch.Tensor, requests: Sequence[SampledRequest]) -> None:
    """In place: add each request's ``logit_bias``, and mask its stop tokens while it has fewer
    than ``min_tokens`` outputs (the engine puts EOS among a min_tokens request's
    ``stop_token_ids``)."""
    bias_rows, bias_ids, biases, stop_rows, stop_ids = [], [], [], [], []
    for row, request in enumerate(requests):
        p = request.sampling_params
        if p.logit_bias:
            bias_rows += [row] * len(p.logit_bias)
            bias_ids += p.logit_bias.keys()
            biases += p.logit_bias.values()
        if p.min_tokens and len(request.output_token_ids) < p.min_tokens:
            stop_rows += [row] * len(p.stop_token_ids)
            stop_ids += p.stop_token_ids
    device = logits.device
    if bias_rows:
        logits.index_put_((torch.tensor(bias_rows, device=device),
                           torch.tensor(bias_ids, device=device)),
                          torch.tensor(biases, dtype=logits.dtype, device=device),
                          accumulate=True)
    if stop_rows:
        logits.index_put_((torch.tensor(stop_rows, device=device),
                           torch.tensor(stop_ids, device=device)),
                          torch.tensor(float("-inf"), dtype=logits.dtype, device=device))


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) what top_k, top_p and min_p exclude, each only where some row uses it."""
    num_rows, vocab = logits.shape
    device = logits.device
    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        k = torch.tensor(top_k, device=device).clamp(max=vocab)[:, None]
        kth = sorted_logits.gather(1, k - 1)
        remove = sorted_logits < kth  # ties with the k-th are kept
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        p = torch.tensor(top_p, dtype=probs.dtype, device=device)[:, None]
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        remove |= ((probs.cumsum(dim=-1) - probs) > p) & (p < 1)
        logits = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=device)
        threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


class Sampler:
    """Samples one token per row of ``logits [S, vocab]`` (float32), row i for ``requests[i]``."""

    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}

    def drop(self, request_ids: Iterable[int]) -> None:
        """Forget ended requests' generators."""
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def verify(self, logits: torch.Tensor, requests: Sequence[VerifiedRequest],
               output: RunnerOutput, token_bitmask: TokenBitmask | None = None) -> RunnerOutput:
        """Speculative verification: ``logits`` has ``1 + num_spec_tokens`` rows per request,
        the row of its last token then one per proposal. Every row is sampled as the token of
        its own position; a request keeps its first sample and, while a sample equals the
        proposal the next row ran, the next one. For a point-mass proposal (n-gram, a greedy
        draft) this is the rejection rule of Leviathan et al. / Chen et al.: a proposal x is
        accepted with probability p(x), and a rejected one is replaced by a draw from p without
        x, the normalised residual. A seeded request's generator is rewound to just after the
        draws of the tokens kept, so its outputs do not depend on speculation."""
        rows = [r for r in requests for _ in range(1 + r.num_spec_tokens)]
        states: dict[int, torch.Tensor] = {}
        result = self(logits, rows, token_bitmask, states)
        tokens, logprobs = result.token_ids, result.logprobs
        row = 0
        for request in requests:
            proposals = request.spec_token_ids
            accepted = 0
            while accepted < len(proposals) and tokens[row + accepted] == proposals[accepted]:
                accepted += 1
            output.sampled_token_ids.append(tokens[row])
            output.logprobs.append(logprobs[row])
            if accepted:
                output.extra_token_ids[request.request_id] = tokens[row + 1:row + 1 + accepted]
                output.extra_logprobs[request.request_id] = logprobs[row + 1:row + 1 + accepted]
            rewind = states.get(row + accepted + 1)
            if accepted < len(proposals) and rewind is not None:
                self._generators[request.request_id].set_state(rewind)
            row += 1 + len(proposals)
        return output

    def __call__(self, logits: torch.Tensor, requests: Sequence[SampledRequest],
                 token_bitmask: TokenBitmask | None = None,
                 generator_states: dict[int, torch.Tensor] | None = None) -> SamplerOutput:
        """One token per row; ``generator_states`` (verification) gets each seeded row's
        generator state before its draw."""
        params = [r.sampling_params for r in requests]
        raw_logits = logits
        biased = any(p.logit_bias or p.min_tokens for p in params)
        if token_bitmask is not None or biased:
            if any(p.logprobs is not None for p in params):
                logits = logits.clone()  # logprobs are of the model's own distribution
            if biased:
                apply_bias_and_min_tokens(logits, requests)
            if token_bitmask is not None:
                rows = torch.tensor(token_bitmask.rows, dtype=torch.int64, device=logits.device)
                masks = token_bitmask.tensor().to(logits.device, non_blocking=True)
                apply_token_bitmask(logits, masks, rows)
        if all(p.greedy and p.logprobs is None and not _has_penalty(p) for p in params):
            # The common decode case: one argmax (each torch call here costs microseconds
            # once a step's weight stream has evicted the caches), on the CPU a plain C++ loop.
            cpu_float32 = logits.device.type == "cpu" and logits.dtype == torch.float32
            tokens = _C.argmax_rows(logits) if cpu_float32 else logits.argmax(dim=-1).tolist()
            return SamplerOutput(tokens, [None] * len(params))
        scores = logits.float()
        if any(_has_penalty(p) for p in params):
            scores = apply_penalties(scores, requests)
        greedy = [p.greedy for p in params]
        tokens = scores.argmax(dim=-1)
        if not all(greedy):
            temperature = torch.tensor([1.0 if g else p.temperature
                                        for g, p in zip(greedy, params)], device=scores.device)
            probs = filter_logits(scores / temperature[:, None], params).softmax(dim=-1)
            # Exponential race: argmax(p / E), E ~ Exp(1), draws a token with probability p.
            race = probs / self._exponentials(probs, requests, greedy, generator_states)
            is_greedy = torch.tensor(greedy, device=scores.device)
            tokens = torch.where(is_greedy, tokens, race.argmax(dim=-1))
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, self._logprobs(raw_logits, tokens, params))

    def _exponentials(self, probs: torch.Tensor, requests: Sequence[SampledRequest],
                      greedy: list[bool],
                      states: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Exp(1) noise ``[S, vocab]``: seeded rows from their own generator, the rest from
        torch's default one."""
        noise = torch.empty_like(probs).exponential_()
        for row, (request, is_greedy) in enumerate(zip(requests, greedy)):
            seed = request.sampling_params.seed
            if seed is None or is_greedy:
                continue
            generator = self._generators.get(request.request_id)
            if generator is None:
                generator = self._new_generator(seed, len(request.output_token_ids), probs)
                self._generators[request.request_id] = generator
            if states is not None:
                states[row] = generator.get_state()
            noise[row].exponential_(generator=generator)
        return noise.clamp_(min=torch.finfo(noise.dtype).tiny)

    @staticmethod
    def _new_generator(seed: int, num_drawn: int, probs: torch.Tensor) -> torch.Generator:
        """A generator seeded with ``seed`` and advanced past the ``num_drawn`` tokens a
        request already sampled (it resumes after preemption where it left off)."""
        generator = torch.Generator(device=probs.device).manual_seed(seed)
        scratch = torch.empty(probs.shape[1], dtype=probs.dtype, device=probs.device)
        for _ in range(num_drawn):
            scratch.exponential_(generator=generator)
        return generator

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                  params: Sequence[SamplingParams]) -> list[TokenLogprobs | None]:
        wanted = [p.logprobs for p in params]
        if all(n is None for n in wanted):
            return [None] * len(params)
        logprobs = logits.float().log_softmax(dim=-1)
        chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        top_n = max(n or 0 for n in wanted)
        top_values, top_ids = (t.tolist() for t in logprobs.topk(top_n, dim=-1))
        return [None if n is None
                else TokenLogprobs(chosen[row], dict(zip(top_ids[row][:n], top_values[row][:n])))
                for row, n in enumerate(wanted)]
