"""llama.cpp's ``gguf.GGUFReader``, with metadata arrays read in one piece.

The reader itself makes a numpy view for every element of an array (two for a string), which
took over 10 seconds for Gemma 3's 262,144-token vocabulary (tokens, scores and token types);
here a number array is one view and a string array one pass over the file's bytes. Fields keep
the reader's layout (``parts``, ``data``, ``types``), so ``ReaderField.contents()`` returns
what it returns for the reader's own; ``contents`` returns the same, a string array decoded in
one pass.
"""
from __future__ import annotations

import struct
import sys
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField

_STRING_ARRAY = [GGUFValueType.ARRAY, GGUFValueType.STRING]


class GGUFArrayReader(GGUFReader):
    """``GGUFReader`` whose metadata arrays of numbers or strings read fast."""

    def _get_field_parts(self, orig_offs: int, raw_type: int
                         ) -> tuple[int, list[Any], list[int], list[GGUFValueType]]:
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        length = self._get(orig_offs + raw_itype.nbytes, np.uint64)
        offs = orig_offs + raw_itype.nbytes + length.nbytes
        item_type = GGUFValueType(int(raw_itype[0]))
        count = int(length[0])
        types = [GGUFValueType.ARRAY, *([item_type] if count else [])]
        number = self.gguf_scalar_to_np.get(item_type)
        if number is not None:  # one part holding every value
            values = self._get(offs, number, count)
            if len(values) != count:
                raise ValueError(f"the array at offset {orig_offs} runs past the end of the file")
            return offs + values.nbytes - orig_offs, [raw_itype, length, values], [2], types
        if item_type != GGUFValueType.STRING:  # arrays of arrays: the reader's own way
            return super()._get_field_parts(orig_offs, raw_type)
        # The file's byte order: "I" is the machine's own, anything else the other one.
        little = (sys.byteorder == "little") == (self.byte_order == "I")
        size_of = struct.Struct("<Q" if little else ">Q").unpack_from
        view = memoryview(self.data)
        end = len(view)
        parts: list[Any] = [raw_itype, length]
        append = parts.append
        for _ in range(count):  # each string: a uint64 byte count, then its UTF-8 bytes
            if offs + 8 > end:
                break
            start = offs + 8
            offs = start + size_of(view, offs)[0]
            append(view[start:offs])
        if len(parts) != 2 + count or offs > end:
            raise ValueError(f"the array at offset {orig_offs} runs past the end of the file")
        return offs - orig_offs, parts, list(range(2, 2 + count)), types


def contents(field: ReaderField) -> Any:
    """``field.contents()``, a string array's strings decoded in one pass."""
    if field.types == _STRING_ARRAY:
        parts = field.parts
        return [str(parts[index], "utf-8") for index in field.data]
    return field.contents()
