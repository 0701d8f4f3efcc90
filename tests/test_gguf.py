"""GGUF loading on small files written here: every tensor type against gguf-py's own
dequantization and against transformers' GGUF loader, logits against transformers, the
tokenizer against transformers' GGUF tokenizer, and every bad-file case by its message."""
from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf_files import (SPECS, TYPES, VOCAB, gguf_tensors, llama_cpp_permute, make_model,
                        write_gguf)
from test_loader import forward_logits

from orca_ext.model import load_model, load_model_info
from orca_ext.model import loader as loader_module
from orca_ext.model.gguf import GGUFFile
from orca_ext.model.gguf_tokenizer import merges_from_scores
from orca_ext.model.loader import open_checkpoint

ARCHS = ["llama", "qwen2", "gpt2", "qwen3", "gemma3", "phi3"]
TEXT = ("the cat and the dog in 12 of 2024, 31415 apples\n\nis it? <|endoftext|> héllo wörld "
        "日本語のテキスト 😀🎉  \t x   y\n  def f(x):\n    return x ** 2  # done\r\n<|im_end|>")


def _types(arch: str, offset: int = 0) -> dict[str, gguf.GGMLQuantizationType]:
    matrices = [n for n, w in gguf_tensors(make_model(arch), arch).items() if w.ndim == 2]
    return {n: TYPES[(i + offset) % len(TYPES)] for i, n in enumerate(matrices)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Per architecture: (folder, file) of a GGUF whose tensors cycle through every type."""
    out = {}
    for arch in ARCHS:
        folder = tmp_path_factory.mktemp(arch)
        out[arch] = folder, write_gguf(make_model(arch), arch, folder / f"{arch}.gguf",
                                       _types(arch))
    return out


def _transformers(folder, file) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=file.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_every_tensor_type_loads_as_gguf_dequantizes_it(arch, files):
    _, file = files[arch]
    reader = gguf.GGUFReader(file)
    stored = {t.name: t for t in reader.tensors}
    assert {t.tensor_type for t in stored.values() if t.data.ndim == 2} >= set(TYPES) - {
        gguf.GGMLQuantizationType.F32}
    model = make_model(arch)
    # Our loaded checkpoint, put back in llama.cpp's layout, equals gguf-py's dequantization
    # of the stored bytes.
    with open_checkpoint(load_model_info(str(file))) as checkpoint:
        ours = {n: checkpoint.get_tensor(n) for n in checkpoint.names()}
    original = gguf_tensors(model, arch)
    for gguf_name, tensor in stored.items():
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(
            original[gguf_name].shape)
        # Our copy of the same tensor under its Hugging Face name, back in llama.cpp's layout.
        hf_name = _hf_name(arch, gguf_name)
        got = ours[hf_name].numpy()
        if arch == "gpt2" and got.ndim == 2 and "blk." in gguf_name:
            got = got.T
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            got = llama_cpp_permute(got, 4 if "attn_q" in gguf_name else 2)
        if arch == "gemma3" and gguf_name.endswith("norm.weight"):
            got = got + 1  # the file's 1 + w, presented as Hugging Face's w
        np.testing.assert_array_equal(got, expected, err_msg=gguf_name)


def _hf_name(arch: str, gguf_name: str) -> str:
    """Hugging Face name of a llama.cpp tensor name (the test's own table)."""
    table = {
        "llama": {"token_embd.weight": "model.embed_tokens.weight",
                  "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"},
        "gpt2": {"token_embd.weight": "transformer.wte.weight",
                 "position_embd.weight": "transformer.wpe.weight",
                 "output_norm.weight": "transformer.ln_f.weight",
                 "output_norm.bias": "transformer.ln_f.bias", "output.weight": "lm_head.weight"},
    }
    family = "gpt2" if arch == "gpt2" else "llama"
    if gguf_name in table[family]:
        return table[family][gguf_name]
    _, layer, part, kind = gguf_name.split(".")
    llama = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
    blocks = {
        "llama": llama,
        "gemma3": llama | {"post_attention_norm": "post_attention_layernorm",
                           "ffn_norm": "pre_feedforward_layernorm",
                           "post_ffw_norm": "post_feedforward_layernorm"},
        "phi3": llama | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
        "gpt2": {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
                 "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
    }
    prefix = "transformer.h." if family == "gpt2" else "model.layers."
    return f"{prefix}{layer}.{blocks.get(arch, blocks[family])[part]}.{kind}"


@pytest.mark.parametrize("arch", ARCHS)
def test_tensors_and_logits_equal_transformers_gguf_load(arch, files):
    folder, file = files[arch]
    hf = _transformers(folder, file)
    with open_checkpoint(load_model_info(str(file))) as checkpoint:
        for name in checkpoint.names():
            torch.testing.assert_close(checkpoint.get_tensor(name), hf.state_dict()[name],
                                       rtol=0, atol=0, msg=name)
    tokens = [5, 17, 100, 260, 3, 99, 42, 7]
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(forward_logits(load_model(str(file), quantization="none"), tokens),
                               expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_equals_transformers_gguf_tokenizer(arch, files):
    folder, file = files[arch]
    expected = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=file.name)
    ours = load_model_info(str(file)).tokenizer
    for text in (TEXT, TEXT.upper(), " leading space", "the" * 40, "12 1212 121"):
        assert ours.encode(text) == expected.encode(text), text
    if arch != "llama":  # byte-level BPE round-trips any text
        assert ours.decode(ours.encode(TEXT), skip_special_tokens=False) == TEXT


def test_sentencepiece_merges_follow_the_scores():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    merges = merges_from_scores(tokens, [0, 0, 0, -1, -2, -3])
    assert merges == [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe", "qwen2", "gpt-2", "gpt-4o", "tekken"])
def test_named_pre_tokenizers_load(pre, tmp_path):
    file = write_gguf(make_model("qwen2"), "qwen2", tmp_path / "m.gguf", pre=pre)
    tokenizer = load_model_info(str(file)).tokenizer
    assert tokenizer.decode(tokenizer.encode(TEXT), skip_special_tokens=False) == TEXT


# Pieces of one text as each pre-tokenizer's regex (llama.cpp's, from the models'
# tokenizer.json) splits it: o200k (Phi-4-mini) splits "HelloWorld" at the case change, keeps a
# contraction on its word, digits in threes and a "/" after a newline on the punctuation;
# tekken (Mistral Nemo) the same but contractions apart and one digit at a time; Llama 3's for
# contrast.
SPLIT_TEXT = "HelloWorld it's 12345 ABCdef\nend.\n/next"
SPLITS = {
    "gpt-4o": ["Hello", "World", " it's", " ", "123", "45", " ABCdef", "\n", "end", ".\n/",
               "next"],
    "tekken": ["Hello", "World", " it", "'s", " ", "1", "2", "3", "4", "5", " ABCdef", "\n",
               "end", ".\n/", "next"],
    "llama-bpe": ["HelloWorld", " it", "'s", " ", "123", "45", " ABCdef", "\n", "end", ".\n",
                  "/next"],
}


@pytest.mark.parametrize("pre", list(SPLITS))
def test_pre_tokenizer_splits(pre, tmp_path):
    file = write_gguf(make_model("qwen2"), "qwen2", tmp_path / "m.gguf", pre=pre)
    inner = load_model_info(str(file)).tokenizer.inner
    pieces = inner.pre_tokenizer.pre_tokenize_str(SPLIT_TEXT)
    assert [SPLIT_TEXT[start:end] for _, (start, end) in pieces] == SPLITS[pre]


def test_folder_with_one_gguf_loads_it(files, tmp_path):
    folder, file = files["qwen2"]
    assert load_model_info(str(folder)).config == load_model_info(str(file)).config
    (tmp_path / "a.gguf").write_bytes(file.read_bytes())
    (tmp_path / "b.gguf").write_bytes(file.read_bytes())
    with pytest.raises(ValueError, match="2 .gguf files.*name one"):
        load_model_info(str(tmp_path))


def _mapped_kb(path) -> int:
    """This process's resident KB of ``path``'s mappings (/proc/self/smaps)."""
    resident, inside = 0, False
    for line in open("/proc/self/smaps"):
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            resident += int(line.split()[1])
    return resident


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps")
def test_loaded_gguf_leaves_no_file_pages_mapped_and_reads_again(files, tmp_path):
    _, file = files["qwen2"]
    copy = tmp_path / "copy.gguf"  # a file no other test of this process has mapped
    copy.write_bytes(file.read_bytes())
    loaded = load_model(str(copy))
    gguf_file = loaded.info.gguf
    assert _mapped_kb(copy) == 0  # the weights were copied out; the file's pages unmapped
    theirs = gguf.GGUFReader(file)
    for tensor in theirs.tensors:  # the tensors read again, from the page cache
        assert np.array_equal(gguf_file.tensors[tensor.name].data, tensor.data), tensor.name
    assert _mapped_kb(copy) > 0


def _bad(tmp_path, **kwargs):
    return write_gguf(make_model("llama"), "llama", tmp_path / "bad.gguf", **kwargs)


def test_bad_files_are_value_errors_naming_file_and_problem(tmp_path, files):
    _, good = files["llama"]
    with pytest.raises(ValueError, match="missing.gguf.*does not exist"):
        load_model(str(tmp_path / "missing.gguf"))
    wrong_magic = tmp_path / "magic.gguf"
    wrong_magic.write_bytes(b"NOPE" + good.read_bytes()[4:])
    with pytest.raises(ValueError, match="magic.gguf.*not a readable GGUF"):
        load_model(str(wrong_magic))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size - 5000])
    with pytest.raises(ValueError, match="truncated.gguf.*(truncated|not a readable)"):
        load_model(str(truncated))
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(good.read_bytes()[:100])
    with pytest.raises(ValueError, match="header.gguf.*not a readable GGUF"):
        load_model(str(header_only))
    missing = _bad(tmp_path, skip=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"bad.gguf.*lacks tensors.*layers\.1\.mlp\.up_proj"):
        load_model(str(missing))
    misshaped = _bad(tmp_path, reshape={"blk.0.attn_v.weight": (64, 256)})
    with pytest.raises(ValueError, match=r"bad.gguf.*v_proj.weight' has shape \(64, 256\), "
                                         r"expected \(128, 256\)"):
        load_model(str(misshaped))
    unknown_pre = _bad(tmp_path, tokenizer="gpt2", pre="no-such-pre")
    with pytest.raises(ValueError, match="bad.gguf.*pre-tokenizer 'no-such-pre'"):
        load_model(str(unknown_pre))


def test_unknown_architecture_and_tensor_type(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "arch.gguf"), "mamba")
    writer.add_tensor("x.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="arch.gguf.*unsupported architecture 'mamba'"):
        load_model(str(tmp_path / "arch.gguf"))
    file = _bad(tmp_path)
    data = bytearray(file.read_bytes())
    # Rewrite the first tensor's type id (after its name, dims and shape) to one with no format.
    reader = gguf.GGUFReader(file)
    first = reader.tensors[0]
    type_field = first.field.parts[-2]
    offset = first.field.offset + sum(p.nbytes for p in first.field.parts[:-2])
    assert struct.unpack_from("<I", data, offset)[0] == int(type_field[0])
    struct.pack_into("<I", data, offset, 250)
    patched = tmp_path / "type.gguf"
    patched.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="type.gguf.*not a readable GGUF"):
        load_model(str(patched))
    ternary = gguf.GGMLQuantizationType.TQ1_0  # BitNet's, which no supported family uses
    writer = gguf.GGUFWriter(str(tmp_path / "tq.gguf"), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 54), np.uint8), raw_shape=(4, 54),
                      raw_dtype=ternary)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="tq.gguf.*'token_embd.weight' has type TQ1_0"):
        GGUFFile(tmp_path / "tq.gguf")


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def llama3_rope_freqs(head_dim: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter (convert_hf_to_gguf.py's LlamaModel) writes
    it for LLAMA3_ROPE: each frequency's divisor."""
    base, factor = LLAMA3_ROPE["rope_theta"], LLAMA3_ROPE["factor"]
    low, high = LLAMA3_ROPE["low_freq_factor"], LLAMA3_ROPE["high_freq_factor"]
    old = LLAMA3_ROPE["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_freqs_equal_transformers(tmp_path):
    """A Llama 3.1-style file (the llama3 rope scaling as llama.cpp's per-frequency divisors,
    rope_freqs.weight, whose wavelengths here span all three of its regimes) gives the logits
    of transformers' model with that scaling, 300 positions deep; a rope_freqs of the wrong
    length is a ValueError naming it."""
    config_cls, model_cls, kwargs = SPECS["llama"]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(
        getattr(transformers, config_cls)(**kwargs, rope_parameters=LLAMA3_ROPE)).eval()
    head_dim = model.config.head_dim
    path = write_gguf(model, "llama", tmp_path / "llama3.gguf",
                      extra={"rope_freqs.weight": llama3_rope_freqs(head_dim)})
    tokens = torch.randint(3, VOCAB, (300,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(tokens[None]).logits[0]
    got = forward_logits(load_model(str(path), quantization="none"), tokens.tolist())
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    write_gguf(model, "llama", tmp_path / "short.gguf",
               extra={"rope_freqs.weight": llama3_rope_freqs(head_dim)[:-1]})
    with pytest.raises(ValueError, match=r"short.gguf: rope_freqs.weight must hold 32 positive"):
        load_model(str(tmp_path / "short.gguf"))


def test_more_tokens_than_embedding_rows_is_a_value_error(tmp_path, monkeypatch):
    file = GGUFFile(_bad(tmp_path))
    file.metadata["tokenizer.ggml.tokens"] = [*file.value("tokenizer.ggml.tokens"), "extra"]
    monkeypatch.setattr(loader_module, "GGUFFile", lambda path: file)
    with pytest.raises(ValueError, match=rf"bad.gguf: the tokenizer has {VOCAB + 1} tokens, "
                                         rf"more than the model's vocab_size {VOCAB}"):
        load_model(str(file.path))
