"""llama.cpp's ``gguf.GGUFReader``, with metadata arrays read in one piece.

The reader itself makes a numpy view for every element of an array (two for a string), which
took over 10 seconds for Gemma 3's 262,144-token vocabulary (tokens, scores and token types);
here a number array is one view and a string array is decoded by the compiled core in one pass
(``_C.gguf_string_array``). Fields keep the reader's layout (``parts``, ``data``, ``types``),
so ``ReaderField.contents()`` returns what it returns for the reader's own (a string array's
parts are its strings' byte views, made when asked for); ``contents`` returns the same, a
string array's strings as decoded in that pass.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField

from .. import _C


class _StringArrayParts(Sequence):
    """A string array field's ``parts``: the parts before its strings (key, type, item type,
    count), then one byte view per string, made when indexed."""

    def __init__(self, head: list[Any], data: np.ndarray, strings: list[str],
                 bounds: np.ndarray) -> None:
        self.head, self.strings = head, strings
        self._data, self._bounds = data, bounds

    def __len__(self) -> int:
        return len(self.head) + len(self.strings)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if index < len(self.head):
            return self.head[index]
        begin, end = self._bounds[index - len(self.head)].tolist()
        return self._data[begin:end]


class GGUFArrayReader(GGUFReader):
    """``GGUFReader`` whose metadata arrays of numbers or strings read fast."""

    def _build_fields(self, offs: int, count: int) -> int:
        # The reader's own loop, but a string array's parts stay one _StringArrayParts (the
        # reader would copy them into a list) and its data indices a range.
        for _ in range(count):
            orig_offs = offs
            key_length, key = self._get_str(offs)
            offs += int(key_length.nbytes + key.nbytes)
            raw_type = self._get(offs, np.uint32)
            offs += int(raw_type.nbytes)
            head = [key_length, key, raw_type]
            if raw_type[0] == GGUFValueType.ARRAY and \
                    self._get(offs, np.uint32)[0] == GGUFValueType.STRING:
                size, parts, indices, types = self._string_array(offs, head)
            else:
                size, parts, indices, types = self._get_field_parts(offs, raw_type[0])
                parts, indices = head + parts, [len(head) + i for i in indices]
            self._push_field(ReaderField(orig_offs, str(bytes(key), encoding="utf-8"), parts,
                                         indices, types), skip_sum=True)
            offs += size
        return offs

    def _string_array(self, orig_offs: int, head: list[Any]
                      ) -> tuple[int, _StringArrayParts, range, list[GGUFValueType]]:
        raw_itype = self._get(orig_offs, np.uint32)
        length = self._get(orig_offs + raw_itype.nbytes, np.uint64)
        offs = orig_offs + raw_itype.nbytes + length.nbytes
        count = int(length[0])
        # The file's byte order: "I" is the machine's own, anything else the other one.
        swap = (sys.byteorder == "little") != (self.byte_order == "I")
        strings, bounds = _C.gguf_string_array(self.data, offs, count, swap)
        end = int(bounds[-1, 1]) if count else offs
        parts = _StringArrayParts([*head, raw_itype, length], self.data, strings, bounds)
        first = len(head) + 2
        types = [GGUFValueType.ARRAY, *([GGUFValueType.STRING] if count else [])]
        return end - orig_offs, parts, range(first, first + count), types

    def _get_field_parts(self, orig_offs: int, raw_type: int
                         ) -> tuple[int, list[Any], list[int], list[GGUFValueType]]:
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        length = self._get(orig_offs + raw_itype.nbytes, np.uint64)
        offs = orig_offs + raw_itype.nbytes + length.nbytes
        item_type = GGUFValueType(int(raw_itype[0]))
        count = int(length[0])
        number = self.gguf_scalar_to_np.get(item_type)
        if number is None:  # arrays of arrays: the reader's own way
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, number, count)  # one part holding every value
        if len(values) != count:
            raise ValueError(f"the array at offset {orig_offs} runs past the end of the file")
        types = [GGUFValueType.ARRAY, *([item_type] if count else [])]
        return offs + values.nbytes - orig_offs, [raw_itype, length, values], [2], types


def contents(field: ReaderField) -> Any:
    """``field.contents()``, a string array's strings as decoded when the file was read."""
    if isinstance(field.parts, _StringArrayParts):
        return list(field.parts.strings)
    return field.contents()
