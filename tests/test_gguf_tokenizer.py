"""GGUF tokenizers against transformers' GGUF tokenizer: Gemma 3's SentencePiece vocabulary
(262,144 tokens with scores, token types and byte fallback) from the built-in ``gemma-3-270m``
file, on ~60 KB of mixed text and on special-token strings; the compiled core's SentencePiece
merges against transformers' own derivation; and ``GGUFArrayReader`` against gguf's reader."""
from __future__ import annotations

import json
import random

import gguf
import numpy as np
import pytest
import transformers
from mixed_text import mixed_text
from transformers.tokenization_utils_base import generate_merges

from orca_ext.model.builtin import DEFAULT_MODEL, builtin_gguf_path
from orca_ext.model.gguf import GGUFFile
from orca_ext.model.gguf_reader import GGUFArrayReader, contents
from orca_ext.model.gguf_tokenizer import gguf_tokenizer, merges_from_scores
from orca_ext.model.tokenizer import bytes_to_unicode

# Gemma's chat turns, its other control and user-defined tokens as text, runs of every kind of
# whitespace (its vocabulary has tokens for runs of up to 31), text that spells a byte token,
# and characters outside the vocabulary (byte fallback). No U+2581: SentencePiece reads it as
# a space, so it does not survive a round trip.
GEMMA_TEXT = (
    "<start_of_turn>user\nWrite a poem about the sea.<end_of_turn>\n<start_of_turn>model\n"
    "<bos>Hello<eos> <pad><unk><mask>[multimodal]<start_of_image><end_of_image><unused42>\n"
    + "".join(f"{n}:{' ' * n}|{chr(9) * n}|{chr(10) * n}|" for n in range(1, 41))
    + " \t \n\t\n \r\n\r\n  <0x41> <0x0A> \x00\x07\x7f \ue000\U000f0000 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 "
    "हिन्दी العربية ελληνικά ﷽ 🧬🫠 https://example.com/a?b=c&d=e 3.14159 1,234,567 "
    "  leading and trailing  "
)
SHORT_TEXTS = ["", " ", "  ", "a", " a", "a ", "\n", "\t", "<start_of_turn>", "<0x41>",
               "x" * 300, " " * 100, "\n" * 100, "日本", "😀", "\U000f0000"]


@pytest.fixture(scope="module")
def gemma_path():
    return builtin_gguf_path("gemma-3-270m")


@pytest.fixture(scope="module")
def ours(gemma_path):
    return gguf_tokenizer(GGUFFile(gemma_path))


@pytest.fixture(scope="module")
def reference(gemma_path):
    return transformers.AutoTokenizer.from_pretrained(str(gemma_path.parent),
                                                      gguf_file=gemma_path.name)


def test_gemma_ids_equal_transformers_on_mixed_text(ours, reference):
    text = mixed_text() + GEMMA_TEXT * 4
    assert len(text.encode()) >= 50_000
    ids = ours.encode(text)
    assert ids[0] == 2  # <bos>: the file's add_bos_token
    assert ids == reference.encode(text)
    plain = ours.encode(text, add_special_tokens=False)
    assert plain == ids[1:] == reference.encode(text, add_special_tokens=False)
    assert ours.decode(plain, skip_special_tokens=False) == text
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    for short in SHORT_TEXTS:
        assert ours.encode(short) == reference.encode(short), repr(short)
        assert ours.decode(ours.encode(short, add_special_tokens=False),
                           skip_special_tokens=False) == short


def test_gemma_vocabulary_pieces(ours, reference):
    assert ours.vocab_size == len(reference) == 262_144
    one = {text: ours.encode(text, add_special_tokens=False)
           for text in ("<start_of_turn>", "<end_of_turn>", "\n\n", "\t\t\t", " " * 31)}
    assert [len(ids) for ids in one.values()] == [1] * len(one)  # each one token
    assert one["<start_of_turn>"] == [105] and one["<end_of_turn>"] == [106]
    # A supplementary private-use character is not in the vocabulary: its UTF-8 bytes as byte
    # tokens.
    fallback = ours.encode("\U000f0000", add_special_tokens=False)
    assert [ours.id_to_token(i) for i in fallback] == ["<0xF3>", "<0xB0>", "<0x80>", "<0x80>"]
    assert reference.convert_ids_to_tokens(fallback) == [ours.id_to_token(i) for i in fallback]
    assert ours.decode(ours.encode("<start_of_turn>hi")) == "hi"  # special ones skipped


def test_gemma_rules_on_a_small_file(tmp_path):
    """A gemma3 file's tokenizer alone, as transformers builds it: space runs stored with real
    spaces and user-defined, merges in vocabulary order whatever the scores, and no prefix space
    even where the file asks for one."""
    tokens = (["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "\n", "  ", "   "]
              + [f"<0x{b:02X}>" for b in range(256)]
              + ["a", "b", "c", "\u2581", "\u2581a", "ab", "bc", "abc", "\u2581ab",
                 "\u2581\u2581a", "ca"])
    types = [3, 3, 3, 2, 3, 4, 4, 4] + [6] * 256 + [1] * 11
    scores = [-1000.0] * 264 + [-float(i) for i in range(11)]
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_add_space_prefix(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = gguf_tokenizer(GGUFFile(tmp_path / "t.gguf"))
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    for text in ("abc a  ab", " ab   abca\n<start_of_turn>x", "bcab  a", "  a", "a   a"):
        assert ours.encode(text) == reference.encode(text), repr(text)
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == \
            reference.decode(reference.encode(text), skip_special_tokens=False)
    assert ours.encode("ab") == [2, 269]  # no "\u2581ab": no prefix space


class _Metadata:
    """The part of a GGUFFile the tokenizer reads: its metadata values, path and architecture."""

    def __init__(self, values: dict) -> None:
        self.values, self.path, self.architecture = values, "meta.gguf", "llama"

    def value(self, key: str, default=None):
        return self.values.get(key, default)


def _byte_level_metadata(extra_tokens: list[str], extra_types: list[int],
                         merges: list[str]) -> _Metadata:
    symbols = list(bytes_to_unicode().values())
    return _Metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
                      "tokenizer.ggml.tokens": symbols + extra_tokens,
                      "tokenizer.ggml.token_type": [1] * len(symbols) + extra_types,
                      "tokenizer.ggml.merges": merges})


def test_byte_level_tokens_spelled_outside_the_alphabet():
    """A token the file spells as text ("日") is the byte-spelled token the merges build
    ("æĹ¥"); a control token spelled so is a mislabel, not special."""
    extra = ["æĹ", "日", "<|日|>", "<|end|>"]
    tokenizer = gguf_tokenizer(_byte_level_metadata(extra, [1, 1, 3, 3], ["æ Ĺ", "æĹ ¥"]))
    first = len(bytes_to_unicode())
    assert tokenizer.encode("日") == [first + 1]
    assert tokenizer.encode("<|end|>") == [first + 3]
    assert first + 2 not in tokenizer.encode("<|日|>")
    assert tokenizer.decode(tokenizer.encode("a 日<|日|>")) == "a 日<|日|>"


def test_byte_level_merge_without_a_space_is_refused():
    with pytest.raises(ValueError, match="meta.gguf: tokenizer merge 'ab' is not two tokens"):
        gguf_tokenizer(_byte_level_metadata(["ab"], [1], ["a b", "ab"]))


def _random_vocabulary(seed: int) -> tuple[list[str], list[float]]:
    """Every character of a small alphabet (non-ASCII included), then random distinct strings
    of 2 to 7 characters; scores with many ties."""
    rng = random.Random(seed)
    alphabet = list("abcé日😀▁ ")
    tokens = list(alphabet)
    seen = set(tokens)
    while len(tokens) < 400:
        token = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 7)))
        if token not in seen:
            seen.add(token)
            tokens.append(token)
    return tokens, [float(rng.randint(-20, 0)) for _ in tokens]


@pytest.mark.parametrize("scores_kind", ["ties", "falling"])
@pytest.mark.parametrize("seed", [0, 1])
def test_merges_equal_transformers_derivation(seed, scores_kind):
    tokens, scores = _random_vocabulary(seed)
    if scores_kind == "falling":  # Gemma's: one score per token, falling along the vocabulary
        scores = [-float(i) for i in range(len(tokens))]
    expected = generate_merges({t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores)))
    assert len(expected) > 100
    assert merges_from_scores(tokens, scores) == expected


def test_gemma_merges_equal_transformers(ours, reference):
    """The merges derived from Gemma 3's whole vocabulary, in order, are those transformers
    derives for the same file."""
    theirs = json.loads(reference.backend_tokenizer.to_str())["model"]["merges"]
    assert len(theirs) > 500_000
    assert json.loads(ours.inner.to_str())["model"]["merges"] == theirs


def test_merges_of_duplicate_tokens_follow_the_last_copy():
    # transformers keeps the last copy's score for a duplicated token: "ab" merges at -2.
    tokens, scores = ["a", "b", "ab", "c", "ab", "bc"], [0, 0, -5, 0, -2, -3]
    assert merges_from_scores(tokens, scores) == [("a", "b"), ("b", "c")]


def test_merges_refuse_bad_input():
    with pytest.raises(ValueError, match="the score of token 1 is NaN"):
        merges_from_scores(["a", "b", "ab"], [0.0, float("nan"), 0.0])
    with pytest.raises(ValueError, match="2 scores for 3 tokens"):
        merges_from_scores(["a", "b", "ab"], [0.0, 0.0])
    with pytest.raises(TypeError, match="token 2 is not a str"):
        merges_from_scores(["a", "b", b"ab"], [0.0, 0.0, 0.0])


def _all_types_file(path, endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> None:
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -300)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -70000)
    writer.add_float32("t.f32", 1.5)
    writer.add_uint64("t.u64", 1 << 40)
    writer.add_int64("t.i64", -(1 << 40))
    writer.add_float64("t.f64", 2.25)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo 😀")
    writer.add_array("t.strings", ["", "a", "日本", "\n", "x" * 1000])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.empty", [])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("b.weight", np.ones(5, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("which", ["all types", "all types, big-endian", DEFAULT_MODEL])
def test_array_reader_reads_what_gguf_reads(which, tmp_path):
    if which.startswith("all types"):
        path = tmp_path / "types.gguf"
        _all_types_file(path, gguf.GGUFEndian.BIG if "big" in which else gguf.GGUFEndian.LITTLE)
    else:
        path = builtin_gguf_path(which)
    theirs, ours = gguf.GGUFReader(path), GGUFArrayReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.contents(), mine.types, mine.offset) == \
            (field.contents(), field.types, field.offset), key
        assert contents(mine) == field.contents(), key
    assert ours.data_offset == theirs.data_offset
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes)
            for t in ours.tensors] == [(t.name, t.tensor_type, list(t.shape), t.data_offset,
                                        t.n_bytes) for t in theirs.tensors]


def test_array_reader_refuses_an_array_past_the_end(tmp_path):
    path = tmp_path / "types.gguf"
    _all_types_file(path)
    data = path.read_bytes()
    cut = data.index(b"x" * 1000) + 500  # inside the last string of t.strings
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    with pytest.raises(ValueError, match="cut.gguf: not a readable GGUF file .*runs past the end"):
        GGUFFile(tmp_path / "cut.gguf")


def test_array_reader_string_parts_are_the_strings_bytes(tmp_path):
    path = tmp_path / "types.gguf"
    _all_types_file(path)
    theirs = gguf.GGUFReader(path).fields["t.strings"]
    mine = GGUFArrayReader(path).fields["t.strings"]
    assert [bytes(mine.parts[i]) for i in mine.data] == \
        [bytes(theirs.parts[i]) for i in theirs.data] == \
        [b"", b"a", "日本".encode(), b"\n", b"x" * 1000]
    assert [bytes(p) for p in mine.parts[mine.data[0]:]] == \
        [bytes(mine.parts[i]) for i in mine.data]
    assert bytes(mine.parts[-1]) == b"x" * 1000
    assert mine.contents(slice(1, 3)) == theirs.contents(slice(1, 3)) == ["a", "日本"]
    assert mine.contents(-1) == "x" * 1000


def test_array_reader_refuses_a_string_count_past_the_end(tmp_path):
    path = tmp_path / "types.gguf"
    _all_types_file(path)
    data = bytearray(path.read_bytes())
    # t.strings: its key, the array type (9), the item type (8: string), then the count (5).
    at = data.index(b"t.strings") + len(b"t.strings") + 8
    assert int.from_bytes(data[at:at + 8], "little") == 5
    data[at:at + 8] = (1 << 40).to_bytes(8, "little")
    (tmp_path / "count.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError,
                       match="count.gguf: not a readable GGUF file .*runs past the end"):
        GGUFFile(tmp_path / "count.gguf")


def test_array_reader_refuses_a_string_that_is_not_utf8(tmp_path):
    path = tmp_path / "types.gguf"
    _all_types_file(path)
    data = path.read_bytes()
    at = data.index("日本".encode())
    (tmp_path / "utf8.gguf").write_bytes(data[:at] + b"\xff\xfe\xfd\xfc\xfb\xfa" + data[at + 6:])
    with pytest.raises(ValueError, match="utf8.gguf: not a readable GGUF file "
                                         "\\(UnicodeDecodeError"):
        GGUFFile(tmp_path / "utf8.gguf")
