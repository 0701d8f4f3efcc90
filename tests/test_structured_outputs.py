"""Structured outputs and tool calls on the default model (SmolLM2-135M-Instruct), checked with
references independent of llguidance: ``jsonschema`` (and the stdlib for the formats it leaves
unchecked), ``re.fullmatch``, ``lark``'s own parser, the ``openai`` client's pydantic parsing.

One engine serves the module: the offline ``LLM`` tests first, then the HTTP app over the same
engine (in-process, through httpx's ASGI transport)."""
from __future__ import annotations

import asyncio
import datetime
import json
import re
import uuid

import grpc
import httpx
import jsonschema
import lark
import llguidance
import openai
import pydantic
import pytest
from json_schemas import SCHEMAS

from orca_ext import LLM, SamplingParams
from orca_ext.async_engine import AsyncEngine
from orca_ext.sampling_params import StructuredOutputsParams
from orca_ext.server import ServingCore, create_app, orca_pb2, orca_pb2_grpc, start_grpc_server
from orca_ext.server.tools import tool_setup

MAX_TOKENS = 120


@pytest.fixture(scope="module")
def llm():
    llm = LLM(max_model_len=1024, max_batch_size=128, kv_cache_tokens=128 * 400)
    yield llm
    llm.shutdown()


def chat(llm: LLM, prompts: list[str], params: list[SamplingParams]):
    return llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)


def json_params(schema: dict, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(
        json=schema), **kwargs)


def check_formats(value, schema: dict) -> None:
    """The formats jsonschema leaves unchecked without extra packages, checked with the stdlib."""
    if isinstance(schema, dict) and isinstance(value, str):
        if schema.get("format") == "date-time":
            datetime.datetime.fromisoformat(value)
        elif schema.get("format") == "date":
            datetime.date.fromisoformat(value)
        elif schema.get("format") == "uuid":
            uuid.UUID(value)
    if isinstance(value, dict) and isinstance(schema, dict):
        for key, item in value.items():
            check_formats(item, schema.get("properties", {}).get(key, {}))
    if isinstance(value, list) and isinstance(schema, dict):
        for item in value:
            check_formats(item, schema.get("items", {}))


def test_json_schema_suite_greedy_and_sampled(llm):
    """>= 50 schemas, greedy and sampled: every finished output validates; one cut by
    max_tokens is a prefix the grammar still accepts; most finish."""
    assert len(SCHEMAS) >= 50
    prompts, params, schemas = [], [], []
    for i, (name, schema) in enumerate(SCHEMAS):
        for sampled in (False, True):
            prompts.append(f"Give an example {name.replace('_', ' ')} as JSON.")
            params.append(json_params(schema, temperature=0.8 if sampled else 0, seed=i))
            schemas.append((name, schema))
    outputs = chat(llm, prompts, params)
    tokenizer = llm.engine.structured._llg_tokenizer()
    cut = []
    for (name, schema), output in zip(schemas, outputs):
        completion = output.outputs[0]
        if completion.finish_reason == "length":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema, overrides={"whitespace_flexible": False})
            matcher = llguidance.LLMatcher(tokenizer, grammar)
            assert matcher.consume_tokens(completion.token_ids), (name, completion.text)
            cut.append(name)
            continue
        assert completion.finish_reason == "stop", (name, completion)
        value = json.loads(completion.text)
        validator = jsonschema.Draft202012Validator(schema,
                                                    format_checker=jsonschema.FormatChecker())
        validator.validate(value)
        check_formats(value, schema)
        outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', "", completion.text)
        assert not re.search(r"\s", outside_strings), completion.text  # compact JSON
    assert len(cut) <= len(outputs) // 10, cut


def test_regex_choice_and_grammars(llm):
    lark_grammar = """
start: greeting " " name "!"
greeting: "Hello" | "Hi"
name: /[A-Z][a-z]{1,8}/
"""
    gbnf = 'root ::= "The answer is " [0-9]+ "."'
    specs = [StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,5}"),
             StructuredOutputsParams(regex=r"(yes|no), because [a-z ]{5,30}\."),
             StructuredOutputsParams(choice=["Paris", "London", "Berlin"]),
             StructuredOutputsParams(grammar=lark_grammar),
             StructuredOutputsParams(grammar=gbnf),
             StructuredOutputsParams(json_object=True)]
    prompts = ["Write a code.", "Is the sky blue?", "What is the capital of France?",
               "Greet someone.", "What is 6 times 7?", "Describe a cat in JSON."]
    for temperature in (0, 1.0):
        outputs = chat(llm, prompts, [SamplingParams(temperature=temperature, seed=3,
                                                     max_tokens=60, structured_outputs=s)
                                      for s in specs])
        texts = [o.outputs[0].text for o in outputs]
        assert all(o.outputs[0].finish_reason == "stop" for o in outputs[:5]), texts
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", texts[0])
        assert re.fullmatch(r"(yes|no), because [a-z ]{5,30}\.", texts[1])
        assert texts[2] in ("Paris", "London", "Berlin")
        lark.Lark(lark_grammar).parse(texts[3])
        assert re.fullmatch(r"The answer is [0-9]+\.", texts[4])
        if outputs[5].outputs[0].finish_reason == "stop":  # any object: it may run long
            assert isinstance(json.loads(texts[5]), dict)


def test_free_requests_unchanged_by_constrained_neighbours(llm):
    """Greedy free requests give the same tokens next to constrained requests as next to free
    ones of the same prompts and lengths (every step has the same shapes, so only the masks
    differ); logprobs are the model's, not the masked distribution's."""
    prompts = ["What is the capital of France?", "A long word:", "Write a haiku about the sea.",
               "Digits:", "A string:", "How many legs does a spider have?"]
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    long_string = {"type": "string", "minLength": 400}  # more than 16 tokens, never done
    specs = (StructuredOutputsParams(regex="[a-z]{400}"),
             StructuredOutputsParams(regex="[0-9]{400}"), StructuredOutputsParams(json=long_string))
    constrained = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                  structured_outputs=s) for s in specs]
    reference = chat(llm, prompts, [free] * 6)
    mixed = chat(llm, prompts, [free, constrained[0], free, constrained[1], constrained[2], free])
    for i in (0, 2, 5):
        assert mixed[i].outputs[0].token_ids == reference[i].outputs[0].token_ids
        for got, want in zip(mixed[i].outputs[0].logprobs, reference[i].outputs[0].logprobs):
            # The prompts' KV is prefix-cached, so each first token comes from a step of the
            # six prompts (the int16 GEMM rounds activations within max |x| / 65534 of each
            # block) in one run and of six single tokens (float32) in the other.
            assert got == pytest.approx(want, abs=2e-3)
    assert re.fullmatch("[a-z]+", mixed[1].outputs[0].text)
    assert re.fullmatch("[0-9]+", mixed[3].outputs[0].text)
    choice = chat(llm, ["Is water wet?"], [SamplingParams(
        temperature=0, max_tokens=4, logprobs=0,
        structured_outputs=StructuredOutputsParams(choice=["maybe"]))])[0].outputs[0]
    # The first token is forced, but its logprob is the model's (far from 0).
    assert choice.text == "maybe" and choice.logprobs[0][choice.token_ids[0]] < -0.5


def test_n_seeds_and_stop_strings(llm):
    """n > 1 samples each follow the grammar; a seeded request repeats; a stop string still
    cuts a constrained output."""
    schema = dict(SCHEMAS[0][1])
    params = json_params(schema, temperature=1.0, seed=11, n=3)
    first = chat(llm, ["A person?"], [params])[0]
    again = chat(llm, ["A person?"], [params])[0]
    assert [c.text for c in first.outputs] == [c.text for c in again.outputs]
    for completion in first.outputs:
        jsonschema.validate(json.loads(completion.text), schema)
    stopped = chat(llm, ["A person?"], [json_params(schema, temperature=0, stop=['"age"'])])[0]
    assert stopped.outputs[0].text.startswith('{"name":') and '"age"' not in \
        stopped.outputs[0].text


def test_preemption_keeps_grammars():
    """Under the paged policy with a KV pool too small for the batch, sequences are preempted
    and recomputed; their matchers carry on and every output still matches (orca-tiny: one
    byte per token, so each output is exactly the pattern's 40 characters)."""
    pattern = "[a-z]{30}[0-9]{10}"
    tiny = LLM("orca-tiny", policy="paged", max_batch_size=8, kv_cache_tokens=128, block_size=8,
               dtype="float32")
    try:
        outputs = tiny.generate([[65 + i] * 5 for i in range(8)], [SamplingParams(
            temperature=1.0, seed=i, max_tokens=60, structured_outputs=StructuredOutputsParams(
                regex=pattern)) for i in range(8)], use_tqdm=False)
        assert tiny.engine.stats().num_preemptions > 0
    finally:
        tiny.shutdown()
    for output in outputs:
        assert re.fullmatch(pattern, output.outputs[0].text), output.outputs[0]


def test_bad_specs_are_value_errors_before_admission(llm):
    for spec, message in [(StructuredOutputsParams(json={"type": "frob"}), "json"),
                          (StructuredOutputsParams(json="{not json"), "not valid JSON"),
                          (StructuredOutputsParams(regex="(a"), "regex"),
                          (StructuredOutputsParams(grammar="start: foo"), "foo")]:
        with pytest.raises(ValueError, match=message):
            llm.generate("hi", SamplingParams(structured_outputs=spec))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
    assert not llm.engine.has_unfinished()


def test_min_tokens_and_logit_bias(llm):
    eos = min(llm.engine.eos_token_ids)
    short = chat(llm, ["Say hi."], [SamplingParams(temperature=0, max_tokens=40)])[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 30
    longer = chat(llm, ["Say hi."], [SamplingParams(temperature=0, max_tokens=40,
                                                    min_tokens=30)])[0].outputs[0]
    assert len(longer.token_ids) >= 30 and eos not in longer.token_ids[:29]
    token = llm.engine.info.tokenizer.encode("banana", add_special_tokens=False)[0]
    biased = chat(llm, ["Say hi."], [SamplingParams(temperature=0, max_tokens=3, logit_bias={
        token: 100})])[0].outputs[0]
    assert biased.token_ids == [token] * 3


# --- the HTTP server over the same engine ------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string",
                                                                 "maxLength": 20}},
                   "required": ["timezone"], "additionalProperties": False}}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def core(llm):
    engine = AsyncEngine(llm.engine)
    yield ServingCore(engine, "smollm2")
    engine.shutdown()


@pytest.fixture(scope="module")
def client(core):
    app = create_app(core)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http,
                              max_retries=0)


def run(coroutine):
    return asyncio.run(coroutine)


def test_openai_parse_and_response_formats(client):
    async def main():
        parsed = await client.chat.completions.parse(
            model="smollm2", messages=[{"role": "user", "content": "Invent a person."}],
            response_format=Person, max_tokens=60, temperature=0)
        obj = await client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Describe a dog."}],
            response_format={"type": "json_object"}, max_tokens=60, temperature=0)
        vllm = await client.completions.create(
            model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0,
            extra_body={"structured_outputs": {"choice": [" Paris", " Rome"]}})
        return parsed, obj, vllm

    parsed, obj, vllm = run(main())
    assert isinstance(parsed.choices[0].message.parsed, Person)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    assert vllm.choices[0].text == " Paris"


def test_tool_calls_required_named_auto(client):
    async def main():
        required = await client.chat.completions.create(
            model="smollm2", messages=WEATHER_QUESTION, tools=[WEATHER, TIME],
            tool_choice="required", max_tokens=80, temperature=0)
        named = await client.chat.completions.create(
            model="smollm2", messages=WEATHER_QUESTION, tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            parallel_tool_calls=False, max_tokens=80, temperature=0)
        auto = await client.chat.completions.create(
            model="smollm2", messages=WEATHER_QUESTION, tools=[WEATHER, TIME],
            max_tokens=40, temperature=0)
        return required, named, auto

    required, named, auto = run(main())
    for reply, names in ((required, {"get_weather", "get_time"}), (named, {"get_time"})):
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.function.name in names
            schema = (WEATHER if call.function.name == "get_weather" else TIME)["function"]
            jsonschema.validate(json.loads(call.function.arguments), schema["parameters"])
    assert len(named.choices[0].message.tool_calls) == 1
    message = auto.choices[0].message  # the model may answer or call; either is well formed
    assert message.content or message.tool_calls


def test_tool_calls_streamed_and_round_trip(client):
    async def main():
        stream = await client.chat.completions.create(
            model="smollm2", messages=WEATHER_QUESTION, tools=[WEATHER],
            tool_choice="required", max_tokens=80, temperature=0, stream=True,
            stream_options={"include_usage": True})
        calls: dict[int, dict] = {}
        finish, usage = None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for delta in choice.delta.tool_calls or []:
                    call = calls.setdefault(delta.index, {"id": None, "name": "",
                                                          "arguments": ""})
                    call["id"] = delta.id or call["id"]
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
        call = calls[0]
        follow_up = await client.chat.completions.create(
            model="smollm2", max_tokens=30, temperature=0, tools=[WEATHER], messages=[
                *WEATHER_QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": call["id"], "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]}}]},
                {"role": "tool", "tool_call_id": call["id"], "content": "22 degrees, sunny"}])
        return calls, finish, usage, follow_up

    calls, finish, usage, follow_up = run(main())
    assert finish == "tool_calls" and usage.completion_tokens > 0
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])
    assert follow_up.choices[0].message.content
    assert follow_up.usage.prompt_tokens > 60  # the call and its result are in the prompt


def test_tool_reply_parsing():
    setup = tool_setup([WEATHER, TIME], "auto", None)
    call = '{"name": "get_time", "arguments": {"timezone": "UTC"}}'
    content, calls = setup.parse(f"Let me check.<tool_call>{call}</tool_call>")
    assert content == "Let me check." and [c.name for c in calls] == ["get_time"]
    assert setup.parse(call)[1][0].arguments == {"timezone": "UTC"}
    assert setup.parse(f"[{call}, {call}]")[0] is None
    assert setup.parse("The weather is fine.") == ("The weather is fine.", [])
    assert setup.parse('{"name": "unknown", "arguments": {}}')[1] == []
    assert setup.held_back("Sure <tool") == len("<tool") and setup.held_back("Sure") == 0


def test_tokenize_detokenize(client):
    async def main():
        http = client._client
        tokens = await http.post("/tokenize", json={"prompt": "Hello world"})
        chat_tokens = await http.post("/tokenize", json={"messages": WEATHER_QUESTION,
                                                         "return_token_strs": True})
        text = await http.post("/detokenize", json={"tokens": tokens.json()["tokens"]})
        bad = await http.post("/detokenize", json={"tokens": [10 ** 7]})
        return tokens.json(), chat_tokens.json(), text.json(), bad

    tokens, chat_tokens, text, bad = run(main())
    assert tokens["count"] == len(tokens["tokens"]) == 2 and tokens["max_model_len"] == 1024
    assert chat_tokens["token_strs"][0] == "<|im_start|>"
    assert text["prompt"] == "Hello world"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_grpc_structured_outputs(core):
    async def main():
        server, port = await start_grpc_server(core, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = orca_pb2_grpc.OrcaStub(channel)

                def request(**params):
                    return stub.Generate(orca_pb2.GenerateRequest(
                        text="The year is", params=orca_pb2.SamplingParameters(
                            max_tokens=12, temperature=0, **params)), timeout=60)

                regex = await request(structured_outputs=orca_pb2.StructuredOutputs(
                    regex=" [0-9]{4}\\."))
                choice = await request(structured_outputs=orca_pb2.StructuredOutputs(
                    choice=orca_pb2.Choices(values=[" now", " then"])), min_tokens=0,
                    logit_bias={11: -100})
                with pytest.raises(grpc.aio.AioRpcError) as bad:
                    await request(structured_outputs=orca_pb2.StructuredOutputs(
                        json='{"type": "frob"}'))
        finally:
            await server.stop(None)
        return regex, choice, bad.value

    regex, choice, bad = run(main())
    assert re.fullmatch(r" [0-9]{4}\.", regex.completions[0].text)
    assert choice.completions[0].text in (" now", " then")
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "frob" in bad.details()
