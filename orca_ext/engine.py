"""The engine: one model iteration per ``step`` (schedule, execute, update), plus what users see
of a request (its text, stop strings, logprobs, ``n`` samples merged into one output)."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .activity import Activity, ActivitySample
from .batch import RunnerOutput, SchedulerOutput, TokenLogprobs
from .chat import ChatTemplate, ChatTemplateError, NoChatTemplateError
from .detokenizer import Detokenizer
from .lora.request import LoRARequest
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .request import Request
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerStats
from .structured import StructuredOutputs, TokenBitmask

if TYPE_CHECKING:
    from .model.loader import ModelInfo

_log = logging.getLogger(__name__)


class PromptError(ValueError):
    """A request the engine cannot take (``Engine.prepare``'s one error type): ``param`` names
    the field, ``code`` is ``"context_length_exceeded"`` for a prompt, or a prompt and its
    ``max_tokens``, longer than the context, ``"no_chat_template"`` for chat messages to a
    model without a chat template."""

    def __init__(self, message: str, param: str | None = "prompt",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


# What a front end passes as a prompt: text, token ids, or chat messages.
Prompt = str | list[int] | list[dict[str, Any]]


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt and its params as ``Engine.prepare`` checked them: ``add_request`` takes it as
    it is."""

    text: str | None  # None for token ids
    token_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # the params' max_tokens, or the rest of the context for None


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

    def __init__(self, executor: Executor | PipelinedExecutor, scheduler: Scheduler,
                 info: ModelInfo) -> None:
        if scheduler.config.num_batches_in_flight == 1:
            self._executor: PipelinedExecutor = _InlineExecutor(executor)
        elif hasattr(executor, "submit") and hasattr(executor, "collect"):
            self._executor = executor
        else:
            raise ValueError("num_batches_in_flight > 1 needs an executor with submit/collect")
        self.executor = executor
        self.scheduler = scheduler
        self.info = info  # the model: limits, tokenizer, stop ids, chat template
        self.eos_token_ids = frozenset(info.eos_token_ids)
        self._chat_template: ChatTemplate | None = None
        self.num_generated_tokens = 0
        self._groups: dict[str, _Group] = {}
        self._sequences: dict[int, _Sequence] = {}
        self._held: list[_Group] = []  # finished, returned when the batch drains (holds_outputs)
        self._next_id = itertools.count()
        self._lock = threading.Lock()
        self.activity = Activity()  # the dashboard's record; read it with activity_sample
        self.structured = StructuredOutputs(info.tokenizer, info.vocab_size, self.eos_token_ids)
        self._num_constrained = 0  # unfinished sequences with a matcher
        if scheduler.speculator is not None:
            scheduler.speculator.allowed_prefix = self._allowed_prefix
        # The runner's LoRA adapters (``lora.manager.LoRAManager``), None without enable_lora.
        self.lora = getattr(executor, "lora_manager", None)

    def add_request(self, request_id: str, prompt: Prompt | PreparedPrompt,
                    params: SamplingParams | None = None, *, arrival_time: float | None = None,
                    stream: bool = True, lora_request: LoRARequest | None = None) -> None:
        """Queue a request: a prompt with its params (``prepare``d here), or one ``prepare``
        gave (then without params). Bad input raises ValueError naming the field, and changes
        nothing. With ``stream`` False (or a scheduler that ``holds_outputs``), ``step``
        reports the request only once it has finished. ``lora_request`` runs it with that LoRA
        adapter (read and checked now, the first time its id is seen)."""
        if isinstance(prompt, PreparedPrompt):
            if params is not None:
                raise ValueError("params: a prepared prompt carries its own")
            prepared = prompt
        else:
            prepared = self.prepare(prompt, params)
        prompt_text, prompt_ids = prepared.text, prepared.token_ids
        params, max_new = prepared.params, prepared.max_new_tokens
        lora_int_id = 0
        if lora_request is not None:
            self.add_lora(lora_request)
            lora_int_id = lora_request.lora_int_id
        spec = params.structured_outputs
        compiled = None if spec is None else self.structured.compile(spec)
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
            detokenizer = (None if self.info.tokenizer is None
                           else Detokenizer(self.info.tokenizer, prompt_ids, params.stop))
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

    def prepare(self, prompt: Prompt, params: SamplingParams | None = None, *,
                add_special_tokens: bool | None = None, chat_template: ChatTemplate | None = None,
                add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
                max_tokens_param: str = "max_tokens") -> PreparedPrompt:
        """The one entrance of a request (``LLM``, HTTP and gRPC): its prompt as token ids (chat
        messages rendered with ``chat_template``, default the model's) and its params checked,
        with vLLM's rule for the output's length: ``max_tokens`` None generates up to the
        context, and a prompt plus an explicit ``max_tokens`` longer than the context is an
        error naming both. Every bad value raises ``PromptError``; nothing changes."""
        text, ids = self.tokenize(prompt, add_special_tokens=add_special_tokens,
                                  chat_template=chat_template,
                                  add_generation_prompt=add_generation_prompt, tools=tools)
        params = self._check_params(params)
        param = "messages" if _is_chat(prompt) else "prompt"
        limit, room = self.info.max_model_len, self.info.max_model_len - len(ids)
        if params.max_tokens is None:
            if room < 1:
                raise PromptError(f"the {param} ({len(ids)} tokens) fills the model's context "
                                  f"({limit} tokens): no room to generate", param,
                                  "context_length_exceeded")
            max_new = room
        elif params.max_tokens > room:
            raise PromptError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the {param}, "
                f"{params.max_tokens} for the completion). Reduce the {param} or "
                f"{max_tokens_param}.", max_tokens_param, "context_length_exceeded")
        else:
            max_new = params.max_tokens
        try:
            self.scheduler.check_fits(len(ids), max_new)
        except ValueError as exc:
            raise PromptError(str(exc), max_tokens_param) from None
        return PreparedPrompt(text, ids, params, max_new)

    def tokenize(self, prompt: Prompt, *, add_special_tokens: bool | None = None,
                 chat_template: ChatTemplate | None = None, add_generation_prompt: bool = True,
                 tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and its token ids, checked against the
        vocabulary and the context (``prepare``'s first half, and POST /tokenize). Chat
        messages are rendered with ``chat_template`` (default: the model's) and tokenized
        without added special tokens (the template writes them) unless
        ``add_special_tokens``. Bad input raises ``PromptError``."""
        param = "prompt"
        if _is_chat(prompt):
            param = "messages"
            prompt = self._render_chat(prompt, chat_template, add_generation_prompt, tools)
            add_special_tokens = bool(add_special_tokens)
        tokenizer = self.info.tokenizer
        if isinstance(prompt, str):
            if tokenizer is None:
                raise PromptError(f"{param}: text needs a tokenizer; send token ids instead",
                                  param)
            text, ids = prompt, []
            if prompt:
                special = True if add_special_tokens is None else add_special_tokens
                try:
                    ids = tokenizer.encode(prompt, add_special_tokens=special)
                except TypeError:  # a tokenizer whose encode takes no such argument
                    ids = tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise PromptError(f"{param}: token ids must be integers", param)
        if not ids:
            raise PromptError(f"{param}: must not be empty", param)
        vocab = self.info.vocab_size
        bad = [t for t in ids if t < 0 or t >= vocab]
        if bad:
            raise PromptError(f"{param}: token id {bad[0]} is outside the vocabulary "
                              f"(size {vocab})", param)
        if len(ids) > self.info.max_model_len:
            raise PromptError(f"This model's maximum context length is "
                              f"{self.info.max_model_len} tokens, but the {param} has {len(ids)} "
                              "tokens", param, "context_length_exceeded")
        return text, ids

    @property
    def chat_template(self) -> ChatTemplate:
        """The model's own chat template (compiled on first use)."""
        if self._chat_template is None:
            self._chat_template = ChatTemplate.for_model(self.info)
        return self._chat_template

    def _render_chat(self, messages: list[dict[str, Any]], template: ChatTemplate | None,
                     add_generation_prompt: bool, tools: list[dict[str, Any]] | None) -> str:
        try:
            return (template or self.chat_template).render(messages, add_generation_prompt,
                                                           tools)
        except NoChatTemplateError as exc:
            raise PromptError(str(exc), "messages", "no_chat_template") from None
        except ChatTemplateError as exc:
            raise PromptError(str(exc), "messages") from None

    def _check_params(self, params: SamplingParams | None) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params)  # re-validates (fields may have been changed); a copy
        if params.stop and self.info.tokenizer is None:
            raise PromptError("stop: stop strings need a tokenizer", "stop")
        # The sampler indexes the logits with these ids.
        vocab = self.info.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("stop_token_ids", params.stop_token_ids if params.min_tokens else ())):
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise PromptError(f"{name}: token id {outside[0]} is outside the vocabulary "
                                  f"(size {vocab})", name)
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


def _is_chat(prompt: object) -> bool:
    """Whether ``prompt`` is chat messages (a list of dicts) rather than text or token ids."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
