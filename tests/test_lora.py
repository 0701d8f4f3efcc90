"""LoRA adapters on the real SmolLM2 (its dequantized HF folder) against transformers + peft:
random PEFT adapters (ranks 4-16, nonzero B, attention-only and all-linear, rsLoRA), greedy
token for token one adapter at a time and in batches mixing adapters and the base; the stored
Q4_1 base against peft on the dequantized weights; the prefix cache keyed by adapter; the pool's
limits; bad adapters."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

peft = pytest.importorskip("peft")

from orca_ext import LLM, LoRARequest, SamplingParams  # noqa: E402
from orca_ext.model import load_model  # noqa: E402
from orca_ext.model.builtin import DEFAULT_MODEL  # noqa: E402
from orca_ext.model.loader import save_pretrained_folder  # noqa: E402

MAX_TOKENS = 8
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot",
           "List three colors:"]
ADAPTERS = {  # name -> (rank, alpha, rsLoRA, target modules)
    "attn8": (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "all16": (16, 8, True, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"]),
    "qv4": (4, 8, False, ["q_proj", "v_proj"]),
    "mlp6": (6, 12, False, ["gate_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """SmolLM2's weights dequantized to float32, as a transformers folder."""
    folder = tmp_path_factory.mktemp("smollm2")
    save_pretrained_folder(load_model(DEFAULT_MODEL, "float32", quantization="none"), folder)
    return folder


@pytest.fixture(scope="module")
def hf_model(hf_folder):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_folder), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(hf_folder):
    return transformers.AutoTokenizer.from_pretrained(str(hf_folder))


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer.encode(p) for p in PROMPTS]


def make_adapter(hf_model, folder, rank, alpha, rslora, targets, seed):
    """A random PEFT adapter (nonzero B) saved to ``folder``; returns the PEFT model."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora,
                             target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(hf_model, config)
    with torch.no_grad():  # B at a size that changes the answers without drowning the base
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.5)
    model.save_pretrained(str(folder))
    return model


@pytest.fixture(scope="module")
def adapters(hf_folder, tmp_path_factory):
    """name -> (LoRARequest, greedy outputs of transformers + peft for every prompt)."""
    root = tmp_path_factory.mktemp("adapters")
    made = {}
    for i, (name, (rank, alpha, rslora, targets)) in enumerate(ADAPTERS.items()):
        base = transformers.AutoModelForCausalLM.from_pretrained(
            str(hf_folder), dtype=torch.float32).eval()
        model = make_adapter(base, root / name, rank, alpha, rslora, targets, seed=i)
        made[name] = (LoRARequest(name, i + 1, str(root / name)), model)
    return made


def hf_greedy(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def references(adapters, hf_model, prompt_ids):
    """(adapter name or None, prompt index) -> transformers (+ peft) greedy tokens."""
    refs = {(None, i): hf_greedy(hf_model, ids) for i, ids in enumerate(prompt_ids)}
    for name, (_, model) in adapters.items():
        for i, ids in enumerate(prompt_ids):
            refs[name, i] = hf_greedy(model, ids)
    return refs


@pytest.fixture(scope="module")
def llm(hf_folder):
    return LLM(str(hf_folder), dtype="float32", enable_lora=True, max_loras=3,
               max_lora_rank=16, max_cpu_loras=4)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def generate(llm, prompt_ids, jobs, adapters):
    """Outputs of one generate call for ``jobs`` [(adapter name or None, prompt index)]."""
    loras = [None if name is None else adapters[name][0] for name, _ in jobs]
    outputs = llm.generate([prompt_ids[i] for _, i in jobs], GREEDY, use_tqdm=False,
                           lora_request=loras)
    return [o.outputs[0].token_ids for o in outputs]


def test_adapters_change_the_answers(references):
    for name in ADAPTERS:
        assert any(references[name, i] != references[None, i] for i in range(len(PROMPTS))), name


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_one_adapter_matches_peft(llm, adapters, prompt_ids, references, name):
    request = adapters[name][0]
    outputs = llm.generate(prompt_ids, GREEDY, use_tqdm=False, lora_request=request)
    assert [o.outputs[0].token_ids for o in outputs] == \
        [references[name, i] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("order", [0, 1, 2])
def test_mixed_batch_matches_peft(llm, adapters, prompt_ids, references, order):
    """Adapters and the base in one packed batch (prefills and decode steps mixed), in varied
    orders; four adapters over three slots also queue for a slot."""
    names = [None, *ADAPTERS]
    jobs = [(names[(i * (order + 1) + order) % len(names)], i % len(PROMPTS))
            for i in range(10)]
    assert generate(llm, prompt_ids, jobs, adapters) == [references[job] for job in jobs]


def test_prefix_cache_is_keyed_by_adapter(llm, adapters, prompt_ids, references):
    """A long shared prompt cached under one adapter is hit by that adapter only."""
    long_prompt = prompt_ids[0] * 12  # several full blocks
    ref_model = adapters["attn8"][1]
    for name in ("attn8", None, "attn8", "qv4"):
        lora = None if name is None else adapters[name][0]
        out = llm.generate([long_prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
        model = ref_model if name == "attn8" else None
        if model is not None:
            assert out.outputs[0].token_ids == hf_greedy(model, long_prompt)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0
    # The second attn8 run hit its blocks; base and qv4 found nothing of attn8's.
    outs = [llm.generate([long_prompt[:-1] + [t]], GREEDY, use_tqdm=False,
                         lora_request=None if n is None else adapters[n][0])[0]
            for n, t in ((None, 11), ("mlp6", 12), ("attn8", 13))]
    cached = [o.num_cached_tokens for o in outs]
    assert cached[0] > 0 and cached[2] > 0  # the base's and attn8's own earlier blocks
    assert cached[1] == 0  # mlp6 never ran this prompt


def llama_cpp_permute(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter's q / k row order (convert_hf_to_gguf.py LlamaModel.permute)."""
    return rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:]) \
        .swapaxes(1, 2).reshape(rows.shape)


def write_gguf_lora(peft_folder: Path, path: Path, config) -> None:
    """A PEFT adapter as llama.cpp's convert_lora_to_gguf.py writes it."""
    import gguf
    from safetensors.torch import load_file

    settings = json.loads((peft_folder / "adapter_config.json").read_text())
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(settings["lora_alpha"]))
    for key, tensor in load_file(peft_folder / "adapter_model.safetensors").items():
        parts = key.split(".")  # base_model.model.model.layers.{i}.{attn|mlp}.{proj}.lora_X.weight
        layer, proj, ab = parts[4], parts[6], parts[7]
        ours = names[proj]
        if ab == "lora_B" and ours in heads:
            tensor = llama_cpp_permute(tensor, heads[ours])
        writer.add_tensor(f"blk.{layer}.{ours}.weight.{ab.lower()}", tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_lora_file_matches_peft(llm, adapters, prompt_ids, references, hf_model, tmp_path):
    """The same adapter as a llama.cpp GGUF LoRA file gives peft's tokens too."""
    request = adapters["attn8"][0]
    write_gguf_lora(Path(request.lora_path), tmp_path / "attn8.gguf", hf_model.config)
    gguf_request = LoRARequest("attn8-gguf", 40, str(tmp_path / "attn8.gguf"))
    outputs = llm.generate(prompt_ids, GREEDY, use_tqdm=False, lora_request=gguf_request)
    assert [o.outputs[0].token_ids for o in outputs] == \
        [references["attn8", i] for i in range(len(PROMPTS))]
    import gguf
    other = gguf.GGUFWriter(str(tmp_path / "qwen.gguf"), "qwen2")
    other.add_string("general.type", "adapter")
    other.add_string("adapter.type", "lora")
    other.write_header_to_file()
    other.write_kv_data_to_file()
    other.write_tensors_to_file()
    other.close()
    with pytest.raises(ValueError, match="made for a qwen2 model, but the base is "
                                         "LlamaForCausalLM"):
        llm.generate(prompt_ids[:1], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("q", 41, str(tmp_path / "qwen.gguf")))


def test_quantized_base_within_its_tolerance(hf_model, adapters, prompt_ids):
    """The stored Q4_1 base with an adapter against peft on the dequantized weights: the
    adapter moves the logits as peft's does, within the quantized base's own error."""
    from orca_ext.lora.manager import LoRAManager
    from orca_ext.model.layers import AttentionMetadata
    from orca_ext.kv import KVCache, build_metadata

    native = load_model(DEFAULT_MODEL, "float32")
    manager = LoRAManager(native.model, 1, 16, 1)
    request, peft_model = adapters["all16"]
    manager.add(request)
    manager.activate(0, request.lora_int_id)
    ids = prompt_ids[2]
    kv = KVCache(native.config, 4, 16, torch.float32, "cpu")

    def logits(lora: bool) -> torch.Tensor:
        cu, ctx, table, slots, positions = build_metadata([[0, 1]], [0], [len(ids)], 16)
        manager.set_step(cu, torch.tensor([0 if lora else -1], dtype=torch.int32))
        try:
            with torch.inference_mode():
                hidden = native.model(torch.tensor(ids), positions, kv,
                                      AttentionMetadata(cu, ctx, table, slots))
                return native.model.compute_logits(hidden, torch.arange(len(ids)))
        finally:
            manager.clear_step()

    with torch.no_grad():
        with peft_model.disable_adapter():
            hf_base = hf_model(torch.tensor([ids])).logits[0]
        hf_lora = peft_model(torch.tensor([ids])).logits[0]
    base_error = (logits(False) - hf_base).abs().max().item()
    lora_error = (logits(True) - hf_lora).abs().max().item()
    shift = (hf_lora - hf_base).abs().max().item()
    assert shift > 4 * base_error  # the adapter's effect is well above the quantization error
    assert lora_error <= 1.5 * base_error + 1e-3


def test_cpu_cache_is_bounded_lru(hf_folder, adapters, prompt_ids, references):
    llm = LLM(str(hf_folder), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=16,
              max_cpu_loras=2, enable_prefix_caching=False)
    manager = llm.engine.lora
    order = ["qv4", "attn8", "mlp6", "qv4"]
    for name in order:
        assert generate(llm, prompt_ids, [(name, 1)], adapters) == [references[name, 1]]
    assert manager.cpu_adapters == [adapters["mlp6"][0].lora_int_id,
                                     adapters["qv4"][0].lora_int_id]
    # One slot: a batch of two adapters runs them one after the other, in arrival order.
    jobs = [("attn8", 0), ("qv4", 3), ("attn8", 2), (None, 1)]
    assert generate(llm, prompt_ids, jobs, adapters) == [references[job] for job in jobs]


def _copy(src, dst, **config_changes):
    shutil.copytree(src, dst)
    if config_changes:
        path = dst / "adapter_config.json"
        config = json.loads(path.read_text())
        config.update(config_changes)
        path.write_text(json.dumps(config))
    return dst


def test_bad_adapters_are_value_errors_and_disturb_nothing(llm, adapters, prompt_ids,
                                                           references, tmp_path, hf_model):
    good = adapters["attn8"][0]
    src = Path(adapters["qv4"][0].lora_path)
    no_weights = _copy(src, tmp_path / "no_weights")
    (no_weights / "adapter_model.safetensors").unlink()
    no_config = _copy(src, tmp_path / "no_config")
    (no_config / "adapter_config.json").unlink()
    broken = _copy(src, tmp_path / "broken")
    (broken / "adapter_config.json").write_text("{not json")
    dora = _copy(src, tmp_path / "dora", use_dora=True)
    # Small stand-ins: the rank and target checks come before any shape is compared.
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=30, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=hf_model.config.vocab_size))
    torch.manual_seed(5)
    for folder, config in (("rank32", peft.LoraConfig(r=32, target_modules=["q_proj"])),
                           ("lm_head", peft.LoraConfig(r=4, target_modules=["lm_head"])),
                           ("other_base", peft.LoraConfig(r=4, target_modules=["q_proj"]))):
        config.init_lora_weights = False
        peft.get_peft_model(copy.deepcopy(other), config).save_pretrained(str(tmp_path / folder))
    cases = [
        (tmp_path / "missing", r"is not a folder \(PEFT\) or a file \(GGUF\)"),
        (no_weights, "no adapter_model.safetensors"),
        (no_config, "no adapter_config.json"),
        (broken, "not valid JSON"),
        (dora, "DoRA"),
        (tmp_path / "rank32", "rank 32 is above max_lora_rank 16"),
        (tmp_path / "lm_head", r"target modules \['lm_head'\] are not attention or MLP"),
        (tmp_path / "other_base", "a different base model"),
    ]
    before = dict(llm.engine.lora.known)
    for i, (path, message) in enumerate(cases):
        request = LoRARequest(f"bad{i}", 100 + i, str(path))
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt_ids[:2], GREEDY, use_tqdm=False, lora_request=request)
        assert dict(llm.engine.lora.known) == before
    assert generate(llm, prompt_ids, [("attn8", 0), (None, 1)], adapters) == \
        [references["attn8", 0], references[None, 1]]
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter"):
        llm.generate(prompt_ids[:1], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("renamed", good.lora_int_id, good.lora_path))
    with pytest.raises(ValueError, match="2 given for 4 prompts"):
        llm.generate(prompt_ids, GREEDY, use_tqdm=False, lora_request=[good, None])
    with pytest.raises(ValueError, match="lora_name 'attn8' is already adapter 1"):
        llm.generate(prompt_ids[:1], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("attn8", 99, good.lora_path))
    assert not llm.engine.has_unfinished()
    assert generate(llm, prompt_ids, [(None, 2), ("attn8", 3)], adapters) == \
        [references[None, 2], references["attn8", 3]]


def test_base_engine_refuses_adapters(hf_folder, adapters, prompt_ids):
    llm = LLM("orca-tiny", dtype="float32")
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=adapters["qv4"][0])
    assert not llm.engine.has_unfinished()
