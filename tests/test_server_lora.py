"""LoRA adapters through the server: a request's ``model`` names its adapter (unknown: 404),
``/v1/models`` lists them with their parent, runtime load / unload (vLLM's bodies) only when
allowed, and ``orca-serve --enable-lora --lora-modules`` end to end."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from server_helpers import ServerProcess  # noqa: E402

from orca_ext import LLM, EngineConfig, LoRARequest, SamplingParams, build_engine  # noqa: E402
from orca_ext.async_engine import AsyncEngine  # noqa: E402
from orca_ext.model import load_model  # noqa: E402
from orca_ext.model.loader import save_pretrained_folder  # noqa: E402
from orca_ext.server import create_app  # noqa: E402
from orca_ext.server.__main__ import main  # noqa: E402

PROMPT = [5, 17, 99, 3, 42, 8]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """A small random Llama as a transformers folder, with orca-tiny's byte tokenizer."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    save_pretrained_folder(load_model("orca-tiny", "float32"), folder)  # the tokenizer files
    config = json.loads((folder / "config.json").read_text())
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=config["vocab_size"], hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=config.get("bos_token_id"), eos_token_id=config.get("eos_token_id"))
    ).save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def adapter_paths(tiny_llama, tmp_path_factory):
    """Two random PEFT adapters for the tiny Llama."""
    root = tmp_path_factory.mktemp("tiny_lora")
    paths = []
    for i, targets in enumerate((["q_proj", "v_proj"], ["o_proj", "up_proj", "down_proj"])):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
        peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=32, target_modules=targets,
                                                   init_lora_weights=False)
                            ).save_pretrained(str(root / f"a{i}"))
        paths.append(str(root / f"a{i}"))
    return paths


@pytest.fixture(scope="module")
def expected(tiny_llama, adapter_paths):
    """Greedy token ids of the prompt on the base and under each adapter, in process."""
    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_loras=2)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    loras = [None, *(LoRARequest(f"x{i}", i + 1, p) for i, p in enumerate(adapter_paths))]
    outs = llm.generate([PROMPT] * 3, params, use_tqdm=False, lora_request=loras)
    ids = [o.outputs[0].token_ids for o in outs]
    assert ids[1] != ids[0] and ids[2] != ids[0]
    return ids


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = AsyncEngine(build_engine(EngineConfig(
        tiny_llama, dtype="float32", device="cpu", max_batch_size=4, kv_cache_tokens=1024,
        enable_lora=True, max_loras=1)))
    yield engine
    engine.shutdown()


async def call(app, method, path, **kwargs):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.request(method, path, **kwargs)


def completion(model: str) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}


def token_ids(response) -> list[int]:
    """The completion's token ids, through its logprobs' token strings (orca-tiny's bytes)."""
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def test_runtime_load_use_unload(engine, adapter_paths):
    app = create_app(engine, model_name="tiny", allow_runtime_lora_updating=True)

    async def scenario():
        r = {}
        r["load"] = await call(app, "POST", "/v1/load_lora_adapter",
                               json={"lora_name": "first", "lora_path": adapter_paths[0]})
        r["again"] = await call(app, "POST", "/v1/load_lora_adapter",
                                json={"lora_name": "first", "lora_path": adapter_paths[1]})
        r["bad"] = await call(app, "POST", "/v1/load_lora_adapter",
                              json={"lora_name": "bad", "lora_path": "/nonexistent"})
        r["missing_field"] = await call(app, "POST", "/v1/load_lora_adapter",
                                        json={"lora_name": "x"})
        r["models"] = await call(app, "GET", "/v1/models")
        r["base"], r["first"] = await asyncio.gather(
            call(app, "POST", "/v1/completions", json=completion("tiny")),
            call(app, "POST", "/v1/completions", json=completion("first")))
        r["chat"] = await call(app, "POST", "/v1/chat/completions", json={
            "model": "nope", "messages": [{"role": "user", "content": "hi"}]})
        r["unknown"] = await call(app, "POST", "/v1/completions", json=completion("nope"))
        r["unload"] = await call(app, "POST", "/v1/unload_lora_adapter",
                                 json={"lora_name": "first"})
        r["after"] = await call(app, "POST", "/v1/completions", json=completion("first"))
        r["unload_again"] = await call(app, "POST", "/v1/unload_lora_adapter",
                                       json={"lora_name": "first"})
        r["models_after"] = await call(app, "GET", "/v1/models")
        return r

    r = asyncio.run(scenario())
    assert r["load"].status_code == 200 and "'first' added" in r["load"].text
    assert r["again"].status_code == 400 and "already been loaded" in r["again"].text
    assert r["bad"].status_code == 400 and "is not a folder" in r["bad"].json()["error"]["message"]
    assert r["missing_field"].status_code == 400
    data = r["models"].json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [("tiny", None), ("first", "tiny")]
    assert data[1]["root"] == adapter_paths[0]
    assert r["first"].json()["model"] == "first" and r["base"].json()["model"] == "tiny"
    assert token_ids(r["first"]) != token_ids(r["base"])
    for name in ("chat", "unknown", "after"):
        assert r[name].status_code == 404, name
        assert r[name].json()["error"]["code"] == "model_not_found"
    assert r["unload"].status_code == 200 and "'first' removed" in r["unload"].text
    assert r["unload_again"].status_code == 404
    assert [m["id"] for m in r["models_after"].json()["data"]] == ["tiny"]


def test_runtime_updates_need_the_flag(engine):
    app = create_app(engine, model_name="tiny")
    response = asyncio.run(call(app, "POST", "/v1/load_lora_adapter",
                                json={"lora_name": "a", "lora_path": "/tmp"}))
    assert response.status_code == 404


def test_unload_waits_for_no_user(engine, adapter_paths):
    """An adapter in use by a running request cannot be unloaded (400); other requests go on."""
    app = create_app(engine, model_name="tiny", allow_runtime_lora_updating=True)

    async def scenario():
        await call(app, "POST", "/v1/load_lora_adapter",
                   json={"lora_name": "busy", "lora_path": adapter_paths[1]})
        long = asyncio.ensure_future(call(app, "POST", "/v1/completions", json={
            **completion("busy"), "max_tokens": 200, "logprobs": None}))
        while not engine.engine.stats().num_running:
            await asyncio.sleep(0.01)
        refused = await call(app, "POST", "/v1/unload_lora_adapter", json={"lora_name": "busy"})
        base = await call(app, "POST", "/v1/completions", json=completion("tiny"))
        loaded = await call(app, "POST", "/v1/load_lora_adapter",
                            json={"lora_name": "late", "lora_path": adapter_paths[0]})
        late = asyncio.ensure_future(call(app, "POST", "/v1/completions",
                                          json=completion("late")))
        running = engine.engine.stats().num_running + engine.engine.stats().num_waiting
        done, late = await long, await late
        unloaded = await call(app, "POST", "/v1/unload_lora_adapter", json={"lora_name": "busy"})
        await call(app, "POST", "/v1/unload_lora_adapter", json={"lora_name": "late"})
        return refused, base, loaded, late, running, done, unloaded

    refused, base, loaded, late, running, done, unloaded = asyncio.run(scenario())
    assert refused.status_code == 400 and "used by 1 unfinished" in refused.text
    assert base.status_code == 200 and done.status_code == 200
    assert done.json()["choices"][0]["finish_reason"] == "length"  # ran to its end undisturbed
    # Loaded while the other adapter's request ran; with one slot it waits for that slot.
    assert loaded.status_code == 200 and late.status_code == 200 and running >= 1
    assert unloaded.status_code == 200


def test_lora_modules_need_enable_lora(capsys):
    assert main(["--model", "orca-tiny", "--lora-modules", "a=/tmp"]) == 2
    assert "need --enable-lora" in capsys.readouterr().err


def test_bad_lora_module_stops_startup(capsys, tmp_path):
    assert main(["--model", "orca-tiny", "--enable-lora", "--lora-modules",
                 f"a={tmp_path / 'none'}"]) == 2
    assert "--lora-modules: adapter 'a'" in capsys.readouterr().err


def test_orca_serve_with_lora_modules(tiny_llama, adapter_paths, expected):
    """The real server process: each adapter's completion is the in-process engine's."""
    server = ServerProcess("--model", tiny_llama, "--served-model-name", "base", "--dtype",
                           "float32", "--enable-lora", "--max-loras", "2",
                           "--lora-modules", f"one={adapter_paths[0]}",
                           f"two={adapter_paths[1]}").start()
    try:
        with server.client() as client:
            models = client.get("/v1/models").json()["data"]
            outs = [client.post("/v1/completions", json={**completion(name), "logprobs": None})
                    for name in ("base", "one", "two")]
            texts = [o.json()["choices"][0]["text"] for o in outs]
            missing = client.post("/v1/load_lora_adapter", json={"lora_name": "x",
                                                                  "lora_path": "/tmp"})
    finally:
        server.stop()
    assert [(m["id"], m["parent"]) for m in models] == \
        [("base", None), ("one", "base"), ("two", "base")]
    tokenizer = load_model("orca-tiny").tokenizer
    assert texts == [tokenizer.decode(ids) for ids in expected]
    assert missing.status_code == 404
