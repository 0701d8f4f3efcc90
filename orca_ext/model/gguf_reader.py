"""llama.cpp's ``gguf.GGUFReader``, with metadata arrays read in one piece.

The reader itself makes a numpy view for every element of an array (two for a string), which
took over 10 seconds for Gemma 3's 262,144-token vocabulary (tokens, scores and token types);
here a number array is one view and a string array one pass over the file's bytes. Fields keep
the reader's layout (``parts``, ``data``, ``types``), so ``ReaderField.contents()`` returns
what it returns for the reader's own.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

_SWAPPED = {"little": "big", "big": "little"}


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
        order = sys.byteorder if self.byte_order == "I" else _SWAPPED[sys.byteorder]
        view = memoryview(self.data)
        parts: list[Any] = [raw_itype, length]
        for _ in range(count):  # each string: a uint64 byte count, then its UTF-8 bytes
            size = int.from_bytes(view[offs:offs + 8], order)
            if offs + 8 + size > len(view):
                raise ValueError(f"the array at offset {orig_offs} runs past the end of the "
                                 "file")
            parts.append(view[offs + 8:offs + 8 + size])
            offs += 8 + size
        return offs - orig_offs, parts, list(range(2, 2 + count)), types
