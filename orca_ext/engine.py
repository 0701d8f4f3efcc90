"""The engine: one model iteration per ``step`` (schedule, execute, update), plus what users see
of a request (its text, stop strings, logprobs, ``n`` samples merged into one output)."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from .activity import Activity, ActivitySample
from .batch import RunnerOutput, SchedulerOutput, TokenLogprobs
from .detokenizer import Detokenizer, Tokenizer
from .lora.request import LoRARequest
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .request import Request
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerStats
from .structured import StructuredOutputs, TokenBitmask

_log = logging.getLogger(__name__)


class PromptError(ValueError):
    """A prompt the engine cannot take; ``param`` names the field, ``code`` is
    ``"context_length_exceeded"`` for one longer than the context."""

    def __init__(self, message: str, param: str = "prompt", code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class Executor(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput: ...


class PipelinedExecutor(Protocol):
    """An executor that runs several batches at once; ``collect`` returns them in submit order."""

    def submit(self, scheduler_output: SchedulerOutput) -> None: ...
    def collect(self) -> RunnerOutput: ...


class _InlineExecutor:
    """``submit``/``collect`` over a synchronous ``execute`` (one batch in flight)."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self._done: deque[RunnerOutput] = deque()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self._done.append(self._executor.execute(scheduler_output))

    def collect(self) -> RunnerOutput:
        return self._done.popleft()


@dataclass
class EngineStats(SchedulerStats):
    num_requests: int = 0  # unfinished user requests (a request with n > 1 counts once)
    num_generated_tokens: int = 0  # since start
    num_iterations: int = 0  # batches run since start
    iteration_seconds: float = 0.0  # their summed time, from each one's step start to its outputs


@dataclass(eq=False)
class _Sequence:
    """Engine-side state of one sample of a user request."""

    request: Request
    group: _Group
    detokenizer: Detokenizer | None
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float | None
    matcher: Any = None  # its llguidance matcher, when its output is constrained
    num_processed: int = 0  # outputs appended to the text, logprobs and matcher so far


@dataclass(eq=False)
class _Group:
    """A user request: its ``n`` sequences, merged into one RequestOutput."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence]
    metrics: RequestMetrics
    stream: bool


class Engine:
    """Runs requests to completion one iteration at a time.

    ``step`` is meant for one thread (the engine loop); ``add_request``, ``abort`` and ``stats``
    may be called from others: a lock guards the scheduler, and is not held while the executor
    runs a batch.
    """

    def __init__(self, executor: Executor | PipelinedExecutor, scheduler: Scheduler, *,
                 max_model_len: int, tokenizer: Tokenizer | None = None,
                 eos_token_ids: Iterable[int] = (), vocab_size: int | None = None,
                 chat_template: str | None = None, bos_token_id: int | None = None,
                 eos_token_id: int | None = None) -> None:
        if scheduler.config.num_batches_in_flight == 1:
            self._executor: PipelinedExecutor = _InlineExecutor(executor)
        elif hasattr(executor, "submit") and hasattr(executor, "collect"):
            self._executor = executor
        else:
            raise ValueError("num_batches_in_flight > 1 needs an executor with submit/collect")
        self.executor = executor
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.chat_template = chat_template  # the model's own (jinja2), None if it has none
        # The tokenizer's own begin and end of sequence: a chat template's bos_token, eos_token.
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.num_generated_tokens = 0
        self._groups: dict[str, _Group] = {}
        self._sequences: dict[int, _Sequence] = {}
        self._held: list[_Group] = []  # finished, returned when the batch drains (holds_outputs)
        self._next_id = itertools.count()
        self._lock = threading.Lock()
        self.activity = Activity()  # the dashboard's record; read it with activity_sample
        self.structured = StructuredOutputs(tokenizer, vocab_size, self.eos_token_ids)
        self._num_constrained = 0  # unfinished sequences with a matcher
        if scheduler.speculator is not None:
            scheduler.speculator.allowed_prefix = self._allowed_prefix
        # The runner's LoRA adapters (``lora.manager.LoRAManager``), None without enable_lora.
        self.lora = getattr(executor, "lora_manager", None)

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, *, arrival_time: float | None = None,
                    stream: bool = True, lora_request: LoRARequest | None = None) -> None:
        """Queue a request. Bad input raises ValueError naming the field, and changes nothing.
        With ``stream`` False (or a scheduler that ``holds_outputs``), ``step`` reports the
        request only once it has finished. ``lora_request`` runs it with that LoRA adapter
        (read and checked now, the first time its id is seen)."""
        prompt_text, prompt_ids = self.tokenize(prompt)
        params = self._check_params(params)
        lora_int_id = 0
        if lora_request is not None:
            self.add_lora(lora_request)
            lora_int_id = lora_request.lora_int_id
        spec = params.structured_outputs
        compiled = None if spec is None else self.structured.compile(spec)
        # vLLM's rule: prompt + output <= max_model_len, but always at least one new token.
        max_new = min(params.max_tokens, max(1, self.max_model_len - len(prompt_ids)))
        self.scheduler.check_fits(len(prompt_ids), max_new)
        stops = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= self.eos_token_ids
        metrics = RequestMetrics(time.time() if arrival_time is None else arrival_time)
        group = _Group(request_id, prompt_text, prompt_ids, [], metrics, stream)
        if params.min_tokens:  # the sampler masks every stop token, EOS included, until then
            params = dataclasses.replace(params, stop_token_ids=sorted(stops))
        for i in range(params.n):
            child = params
            if params.n > 1:  # distinct seeds, else the n samples would be identical
                child = dataclasses.replace(
                    params, n=1, seed=None if params.seed is None else params.seed + i)
            request = Request(next(self._next_id), prompt_ids, child, max_new, stops,
                              lora_int_id=lora_int_id)
            detokenizer = (None if self.tokenizer is None
                           else Detokenizer(self.tokenizer, prompt_ids, params.stop))
            wants_logprobs = params.logprobs is not None
            group.sequences.append(_Sequence(
                request, group, detokenizer, [] if wants_logprobs else None,
                0.0 if wants_logprobs else None,
                None if compiled is None else compiled if i == 0 else compiled.deep_copy()))
        with self._lock:
            if request_id in self._groups:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            self._groups[request_id] = group
            for i, seq in enumerate(group.sequences):
                self._sequences[seq.request.request_id] = seq
                self._num_constrained += seq.matcher is not None
                self.scheduler.add_request(seq.request)
                self.activity.arrived(seq.request.request_id,
                                      request_id if params.n == 1 else f"{request_id}/{i}",
                                      len(prompt_ids), metrics.arrival_time)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Know a LoRA adapter (read and checked now; nothing changes if it is bad: ValueError)."""
        if self.lora is None:
            raise ValueError(f"lora_request: adapter {lora_request.lora_name!r} needs an engine "
                             "built with enable_lora=True")
        self.lora.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> LoRARequest:
        """Forget an adapter; KeyError if unknown, ValueError while unfinished requests use it."""
        if self.lora is None or lora_int_id not in self.lora.known:
            raise KeyError(lora_int_id)
        with self._lock:
            users = sum(not seq.request.finished and seq.request.lora_int_id == lora_int_id
                        for seq in self._sequences.values())
            if users:
                raise ValueError(f"LoRA adapter {self.lora.known[lora_int_id].lora_name!r} is "
                                 f"used by {users} unfinished requests")
            if self.scheduler.lora_slots is not None:
                self.scheduler.lora_slots.forget(lora_int_id)
            return self.lora.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora is None else list(self.lora.known.values())

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its KV; return its final output (None if it is not known)."""
        with self._lock:
            group = self._groups.pop(request_id, None)
            if group is None:
                return None
            if group in self._held:
                self._held.remove(group)
            group.metrics.finish_time = time.time()
            for seq in group.sequences:
                self.scheduler.abort(seq.request.request_id)
                self._forget(seq)
                self.activity.ended(seq.request, group.metrics.finish_time)
            return self._output(group)

    def shutdown(self) -> None:
        """Release the executor's resources (a distributed executor stops its workers)."""
        self.structured.shutdown()
        shutdown = getattr(self.executor, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def has_unfinished(self) -> bool:
        return bool(self._groups) or self.scheduler.num_batches_in_flight > 0

    def step(self) -> list[RequestOutput]:
        """Launch batches until ``num_batches_in_flight`` are out, wait for the oldest, and
        return the outputs of the requests it advanced (finished ones with their KV freed)."""
        started = time.time()
        with self._lock:
            batches = []
            while (batch := self.scheduler.schedule()).requests:
                if self._num_constrained:
                    batch.token_bitmask = self._token_bitmask(batch)
                batches.append(batch)
                self.activity.launched(batch, started)
        for batch in batches:
            self._executor.submit(batch)
        if not self.scheduler.num_batches_in_flight:
            with self._lock:
                return self._release_held(time.time())
        result = self._executor.collect()
        with self._lock:
            return self._process(result)

    def stats(self) -> EngineStats:
        with self._lock:
            return self._stats()

    def activity_sample(self, after_iteration: int = -1, after_event: int = -1
                        ) -> tuple[ActivitySample, EngineStats]:
        """The iterations and request events recorded after the given numbers (-1: all kept),
        the unfinished sequences, and the stats, in one short hold of the lock."""
        with self._lock:
            sample = self.activity.sample(after_iteration, after_event, self.scheduler.waiting,
                                          self.scheduler.running)
            return sample, self._stats()

    def _stats(self) -> EngineStats:
        return EngineStats(**dataclasses.asdict(self.scheduler.stats()),
                           num_requests=len(self._groups),
                           num_generated_tokens=self.num_generated_tokens,
                           num_iterations=self.activity.num_iterations,
                           iteration_seconds=self.activity.iteration_seconds)

    def tokenize(self, prompt: str | list[int], *, add_special_tokens: bool = True,
                 param: str = "prompt") -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and its token ids, checked: the one prompt
        validator, for ``add_request`` and the servers. Bad input raises ``PromptError``."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise PromptError(f"{param}: text needs a tokenizer; send token ids instead",
                                  param)
            text, ids = prompt, []
            if prompt:
                try:
                    ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
                except TypeError:  # a tokenizer whose encode takes no such argument
                    ids = self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise PromptError(f"{param}: token ids must be integers", param)
        if not ids:
            raise PromptError(f"{param}: must not be empty", param)
        bad = [t for t in ids if t < 0 or (self.vocab_size is not None and t >= self.vocab_size)]
        if bad:
            raise PromptError(f"{param}: token id {bad[0]} is outside the vocabulary "
                              f"(size {self.vocab_size})", param)
        if len(ids) > self.max_model_len:
            raise PromptError(f"This model's maximum context length is {self.max_model_len} "
                              f"tokens, but the {param} has {len(ids)} tokens", param,
                              "context_length_exceeded")
        return text, ids

    def _check_params(self, params: SamplingParams | None) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params)  # re-validates (fields may have been changed); a copy
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer")
        # The sampler indexes the logits with these ids.
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("stop_token_ids", params.stop_token_ids if params.min_tokens else ())):
            outside = [t for t in ids if self.vocab_size is not None and t >= self.vocab_size]
            if outside:
                raise ValueError(f"{name}: token id {outside[0]} is outside the vocabulary "
                                 f"(size {self.vocab_size})")
        return params

    def _process(self, result: RunnerOutput) -> list[RequestOutput]:
        logprobs = dict(zip(result.request_ids, result.logprobs))
        now = time.time()
        touched: dict[str, _Group] = {}
        for request in self.scheduler.update(result):
            seq = self._sequences[request.request_id]
            touched[seq.group.request_id] = seq.group
            if seq.group.metrics.first_token_time is None:
                seq.group.metrics.first_token_time = now
            new_logprobs = [logprobs[request.request_id],
                            *result.extra_logprobs.get(request.request_id, ())]
            new_tokens = request.output_token_ids[seq.num_processed:]
            for i, token_id in enumerate(new_tokens):
                last = i == len(new_tokens) - 1
                stopped = self._append(seq, token_id, new_logprobs[i], last)
                self.num_generated_tokens += 1
                if stopped and not last:  # the accepted tokens after it are dropped
                    request.truncate_output(seq.num_processed + i + 1)
                    break
            seq.num_processed = len(request.output_token_ids)
        outputs = []
        holds = self.scheduler.holds_outputs
        for group in touched.values():
            if all(seq.request.finished for seq in group.sequences):
                if holds:
                    self._held.append(group)
                else:
                    outputs.append(self._end(group, now))
            elif group.stream and not holds:
                outputs.append(self._output(group))
        outputs += self._release_held(now)
        self.activity.returned(result.batch_id, time.time())  # the whole step, outputs built
        return outputs

    def _release_held(self, now: float) -> list[RequestOutput]:
        """The held finished requests, once the batch they ran in has drained."""
        if not self._held or self.scheduler.running:
            return []
        held, self._held = self._held, []
        return [self._end(group, now) for group in held]

    def _end(self, group: _Group, now: float) -> RequestOutput:
        group.metrics.finish_time = now
        del self._groups[group.request_id]
        for seq in group.sequences:
            self._forget(seq)
            self.activity.ended(seq.request, now)
        return self._output(group)

    def _forget(self, seq: _Sequence) -> None:
        del self._sequences[seq.request.request_id]
        if seq.matcher is not None:
            seq.matcher = None
            self._num_constrained -= 1

    def _token_bitmask(self, batch: SchedulerOutput) -> TokenBitmask | None:
        """Start computing the masks of the batch's constrained sampled requests (the runner
        samples the requests with ``sample`` set, in order, each on ``1 + num_spec_tokens``
        rows: its masks follow its grammar through its proposals)."""
        matchers = []
        row = 0
        for r in batch.requests:
            if not r.sample:
                continue
            matcher = self._sequences[r.request_id].matcher
            if matcher is not None:
                spec = r.token_ids[len(r.token_ids) - r.num_spec_tokens:]
                matchers.append((row, matcher, spec))
            row += 1 + r.num_spec_tokens
        return self.structured.bitmask(matchers) if matchers else None

    def _allowed_prefix(self, request: Request, proposals: list[int]) -> int:
        """How many of ``proposals`` the request's grammar allows (all, unconstrained)."""
        matcher = self._sequences[request.request_id].matcher
        return len(proposals) if matcher is None else matcher.validate_tokens(proposals)

    def _advance_matcher(self, seq: _Sequence, token_id: int) -> bool:
        """Feed the sampled token to the sequence's matcher; end the sequence (its token kept
        in the text) where the grammar is complete and can take no more, and say so."""
        matcher = seq.matcher
        if not matcher.consume_token(token_id):
            _log.warning("request %s: its grammar refused a sampled token (%s); ending it",
                         seq.group.request_id, matcher.get_error())
        if matcher.is_stopped():
            self.scheduler.finish(seq.request, "stop")
            return True
        return False

    def _append(self, seq: _Sequence, token_id: int, logprobs: TokenLogprobs | None,
                last: bool = True) -> bool:
        """Add one output token to the text, logprobs and matcher (``last``: the step's last
        one, where the scheduler's finish, if any, applies); True where a stop string or the
        grammar ends the request at this token."""
        request = seq.request
        ended = request.finished and last
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append({token_id: logprobs.logprob, **logprobs.top})
            seq.cumulative_logprob += logprobs.logprob
        stopped = False
        if seq.matcher is not None and not ended:
            stopped = self._advance_matcher(seq, token_id)
        detokenizer = seq.detokenizer
        if detokenizer is None:
            return stopped
        stop = None
        # A stop token is kept in token_ids, not in the text.
        if not (ended and request.finish_reason == "stop" and request.stop_reason == token_id):
            stop = detokenizer.append(token_id)
        if stop is None and (ended or stopped):
            stop = detokenizer.flush()
        if stop is not None:
            self.scheduler.finish(request, "stop", stop)
            stopped = True
        return stopped

    def _output(self, group: _Group) -> RequestOutput:
        outputs = []
        for index, seq in enumerate(group.sequences):
            request = seq.request
            text = "" if seq.detokenizer is None else seq.detokenizer.output_text(request.finished)
            outputs.append(CompletionOutput(
                index, text, list(request.output_token_ids), seq.cumulative_logprob,
                None if seq.logprobs is None else list(seq.logprobs),
                request.finish_reason, request.stop_reason))
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs,
                             all(o.finished() for o in outputs), dataclasses.replace(group.metrics),
                             group.sequences[0].request.num_cached_tokens or 0)
