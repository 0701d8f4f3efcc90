"""Text for the tokenizer tests: about 60 KB of English prose (the documentation every Python
ships) and Python code, with emoji, accents, CJK, Korean, tabs, runs of spaces and newlines."""
from __future__ import annotations

import inspect
import json
import pydoc_data.topics

import pytest


def mixed_text() -> str:
    prose = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))[:40000]
    code = inspect.getsource(json.decoder) + inspect.getsource(inspect.getmodule(pytest.fixture))
    extras = ("😀🎉👍🏽 naïve café – “quotes” — 日本語のテキストと中文字符，한국어 문장. "
              "\t\ttabs   and    spaces\n\n\n\n  indented\r\nwindows\n" * 60)
    return prose + code[:15000] + extras
