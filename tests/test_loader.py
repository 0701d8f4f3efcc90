"""Loading Hugging Face folders and the built-in model; saving back to a folder."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from orca_ext.kv import KVCache, SlotAllocator
from orca_ext.model import (AttentionMetadata, ModelConfig, load_model, save_pretrained_folder)
from tiny_models import VOCAB, make_hf_model, save_hf_model


def forward_logits(loaded, tokens: list[int]) -> torch.Tensor:
    """float32 logits of every position of one prompt, through our model."""
    n = len(tokens)
    allocator = SlotAllocator(n, 1)
    allocator.allocate(0, n)
    meta = allocator.build_metadata([0], [0], [n])
    kv_cache = KVCache(loaded.config, n, 1, loaded.dtype)
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(tokens), meta[4], kv_cache, AttentionMetadata(*meta[:4]))
        return loaded.model.compute_logits(hidden, torch.arange(n))


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    model = make_hf_model("llama_gqa")
    return model, save_hf_model(model, tmp_path_factory.mktemp("llama"))


def copy_folder(src, tmp_path):
    return shutil.copytree(src, tmp_path / "copy")


TOKENS = [5, 17, 200, 3, 99, 42, 7]


def test_missing_folder_names_it():
    with pytest.raises(FileNotFoundError, match="no/such/folder.*orca-tiny"):
        load_model("no/such/folder")


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))


def test_unsupported_architecture_is_named_with_the_supported_ones(llama_folder, tmp_path):
    folder = copy_folder(llama_folder[1], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["BertForMaskedLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="BertForMaskedLM.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        load_model(str(folder))


def test_missing_tensor_is_named(llama_folder, tmp_path):
    folder = copy_folder(llama_folder[1], tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="lacks tensors.*layers.1.self_attn.k_proj.weight"):
        load_model(str(folder))


def test_mismatched_shape_is_named(llama_folder, tmp_path):
    folder = copy_folder(llama_folder[1], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] += 8
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"gate_proj.weight' has shape \(96, 64\), expected "
                                         r"\(104, 64\)"):
        load_model(str(folder))


def test_unexpected_tensor_is_named(llama_folder, tmp_path):
    folder = copy_folder(llama_folder[1], tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="does not use.*q_norm"):
        load_model(str(folder))


@pytest.mark.parametrize("file,message", [("tokenizer.json", "tokenizer.json"),
                                          ("model.safetensors", "no \\*.safetensors")])
def test_missing_tokenizer_or_weights(llama_folder, tmp_path, file, message):
    folder = copy_folder(llama_folder[1], tmp_path)
    (folder / file).unlink()
    with pytest.raises(FileNotFoundError, match=message):
        load_model(str(folder))


def test_sharded_checkpoint_loads_the_same_weights(llama_folder, tmp_path):
    hf, folder = llama_folder
    sharded = save_hf_model(hf, tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    torch.testing.assert_close(forward_logits(load_model(str(sharded)), TOKENS),
                               forward_logits(load_model(str(folder)), TOKENS), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", torch.bfloat16])
def test_half_dtypes(llama_folder, dtype):
    hf, folder = llama_folder
    loaded = load_model(str(folder), dtype=dtype)
    assert all(p.dtype == loaded.dtype for p in loaded.model.parameters())
    assert loaded.dtype in (torch.bfloat16, torch.float16)
    with torch.no_grad():
        expected = hf(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(forward_logits(loaded, TOKENS), expected, atol=0.1, rtol=0.05)


def test_unsupported_dtype():
    with pytest.raises(ValueError, match="int8.*float32, bfloat16, float16"):
        load_model("orca-tiny", dtype="int8")


def test_eos_and_chat_template(llama_folder, tmp_path):
    folder = copy_folder(llama_folder[1], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = 2
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    loaded = load_model(str(folder))
    assert loaded.info.eos_token_ids == [7, 2]
    assert loaded.info.chat_template == "{{ x }}"
    assert loaded.info.max_model_len == 256


def test_config_variants():
    base = dict(architectures=["MistralForCausalLM"], vocab_size=10, hidden_size=8,
                intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=4096, sliding_window=1024)
    mistral = ModelConfig.from_hf(base)  # the window is honoured, not a cap on the context
    assert mistral.max_model_len == 4096 and mistral.layer_window(0) == 1024
    legacy = dict(base, architectures=["LlamaForCausalLM"], rope_theta=500000.0,
                  rope_scaling={"type": "linear", "factor": 4.0})
    config = ModelConfig.from_hf(legacy)
    assert config.rope_theta == 500000.0 and config.rope_scaling == {"rope_type": "linear",
                                                                     "factor": 4.0}
    assert config.max_model_len == 4096 and config.num_kv_heads == 2
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        ModelConfig.from_hf(dict(base, rope_parameters={"rope_type": "yarn", "factor": 2.0}))
    with pytest.raises(ValueError, match="hidden_act 'relu'"):
        ModelConfig.from_hf(dict(base, hidden_act="relu"))
    with pytest.raises(ValueError, match="lacks the key 'hidden_size'"):
        ModelConfig.from_hf({k: v for k, v in base.items() if k != "hidden_size"})


def test_orca_tiny_is_builtin_and_deterministic():
    loaded = load_model("orca-tiny")
    params = sum(p.numel() for p in loaded.model.parameters())
    assert 10e6 < params < 100e6
    assert loaded.info.max_model_len == 1024 and loaded.info.eos_token_ids == [256]
    text = "héllo, wörld ✓"
    ids = loaded.tokenizer.encode(text)
    assert ids == list(text.encode())
    assert loaded.tokenizer.decode(ids + [256]) == text
    again = load_model("orca-tiny", dtype="bfloat16")
    for a, b in zip(loaded.model.parameters(), again.model.parameters()):
        torch.testing.assert_close(a.to(torch.bfloat16), b, rtol=0, atol=0)


def test_orca_tiny_saved_folder_loads_in_transformers(tmp_path):
    loaded = load_model("orca-tiny")
    folder = save_pretrained_folder(loaded, tmp_path / "orca-tiny")
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    tokens = loaded.tokenizer.encode("Orca schedules iterations.")
    assert tokenizer(text="Orca schedules iterations.").input_ids == tokens
    assert tokenizer.eos_token_id == 256
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(forward_logits(loaded, tokens), expected, atol=1e-4, rtol=1e-4)
    reloaded = load_model(str(folder))
    torch.testing.assert_close(forward_logits(reloaded, tokens), forward_logits(loaded, tokens),
                               rtol=0, atol=0)


@pytest.mark.parametrize("name", ["qwen2", "llama_tied"])
def test_llama_family_round_trip(name, tmp_path):
    hf = make_hf_model(name)
    loaded = load_model(str(save_hf_model(hf, tmp_path / "src")))
    folder = save_pretrained_folder(loaded, tmp_path / "dst")
    again = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokens = torch.randint(0, VOCAB, (1, 9)).tolist()[0]
    with torch.no_grad():
        torch.testing.assert_close(again(torch.tensor([tokens])).logits,
                                   hf(torch.tensor([tokens])).logits, rtol=0, atol=0)
