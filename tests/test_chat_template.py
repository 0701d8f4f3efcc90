"""Chat templates: the model's own, one given with ``orca-serve --chat-template`` (a file or the
text) or ``LLM.chat(chat_template=...)``, and a model without one (orca-tiny), whose chat
requests are refused with a 400 / ValueError that says how to give one."""
from __future__ import annotations

import asyncio

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from engine_fakes import CharTokenizer, FakeSlotAllocator, KVFakeRunner, fake_info  # noqa: E402

from orca_ext import LLM, SamplingParams  # noqa: E402
from orca_ext.chat import (  # noqa: E402
    ChatTemplate, NoChatTemplateError, load_chat_template,
)
from orca_ext.distributed import ParallelConfig  # noqa: E402
from orca_ext.engine import Engine, PromptError  # noqa: E402
from orca_ext.scheduler import SchedulerConfig, make_scheduler  # noqa: E402
from orca_ext.server.__main__ import build_core, build_parser  # noqa: E402
from orca_ext.server.http import create_app  # noqa: E402

USER = [{"role": "user", "content": "hi"}]
# orca-tiny's tokenizer is one token per UTF-8 byte, and <|endoftext|> (256) is its bos and eos.
TINY_SPECIAL = 256
TAGGED = "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}" \
         "{{ eos_token }}"


@pytest.fixture(scope="module")
def llm():
    with LLM("orca-tiny", device="cpu", max_batch_size=2, kv_cache_tokens=256) as llm:
        yield llm


def test_llm_chat_without_a_template_is_a_value_error(llm):
    with pytest.raises(PromptError, match=r"no chat template.*chat_template=") as error:
        llm.chat(USER, SamplingParams(max_tokens=1), use_tqdm=False)
    assert isinstance(error.value, ValueError) and error.value.code == "no_chat_template"


def test_llm_chat_renders_the_given_template(llm):
    (output,) = llm.chat(USER, SamplingParams(max_tokens=1), use_tqdm=False,
                         chat_template=TAGGED)
    assert output.prompt_token_ids == [TINY_SPECIAL, *"<user>hi".encode(), TINY_SPECIAL]


def test_a_given_template_replaces_the_models_own():
    allocator = FakeSlotAllocator(64, 4)
    tokenizer = CharTokenizer()
    engine = Engine(KVFakeRunner(allocator, tokenizer.vocab),
                    make_scheduler(SchedulerConfig(max_batch_size=2), allocator),
                    fake_info(64, tokenizer.vocab, tokenizer,
                              chat_template="own: {{ messages[0]['content'] }}"))
    assert ChatTemplate.for_model(engine.info).render(USER) == "own: hi"
    assert ChatTemplate.for_model(engine.info, "given: {{ messages | length }}").render(USER) \
        == "given: 1"
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate.for_model(engine.info, "{% for %}")


def test_load_chat_template(tmp_path):
    assert load_chat_template(None) is None
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}", encoding="utf-8")
    assert load_chat_template(str(path)) == path.read_text(encoding="utf-8")
    # The text itself: backslash escapes decoded (as vLLM does), other characters kept.
    assert load_chat_template(r"{{ 'é→😀' }}\n\t") == "{{ 'é→😀' }}\n\t"
    missing = str(tmp_path / "missing.jinja")
    with pytest.raises(ValueError, match=f"--chat-template '{missing}' looks like a file name"):
        load_chat_template(missing)


# --- the server -------------------------------------------------------------------------------

TINY = ["--model", "orca-tiny", "--device", "cpu", "--dtype", "float32", "--kv-cache-tokens",
        "256", "--max-num-seqs", "2"]


def post(core, path: str, body: dict) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=create_app(core))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body)

    return asyncio.run(main())


@pytest.fixture
def serve():
    """``serve(*args)``: orca-serve's serving core for orca-tiny with ``args``, built in-process
    as the CLI builds it."""
    built = []

    def make(*args: str):
        core, banner = build_core(build_parser().parse_args([*TINY, *args]), ParallelConfig())
        built.append(core)
        return core, banner

    yield make
    for core in built:
        core.engine.shutdown()


def chat_prompt_tokens(core) -> int:
    """The prompt length of a chat request's answer (orca-tiny: bytes, plus its special
    tokens)."""
    response = post(core, "/v1/chat/completions",
                    {"messages": USER, "max_tokens": 1, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


def test_server_without_a_template_refuses_chat_with_400(serve):
    core, banner = serve()
    response = post(core, "/v1/chat/completions", {"messages": USER, "max_tokens": 1})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "no_chat_template"
    assert "no chat template" in error["message"] and "--chat-template" in error["message"]
    completion = post(core, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert completion.status_code == 200, completion.text
    assert any("chat template: none" in line for line in banner)


@pytest.mark.parametrize("as_file", [False, True])
def test_server_chat_template_flag(serve, tmp_path, as_file):
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}" \
               "{{ eos_token }}"
    if as_file:
        path = tmp_path / "chat.jinja"
        path.write_text(template, encoding="utf-8")
        value = str(path)
    else:  # the text on a command line, its newline written \n
        value = template.replace("\n", r"\n")
    core, banner = serve("--chat-template", value)
    assert core.chat_template.render(USER) == "[user]hi\n<|endoftext|>"
    assert chat_prompt_tokens(core) == len("[user]hi\n") + 1
    assert any("chat template: --chat-template" in line for line in banner)


def test_server_chat_template_flag_naming_a_missing_file(serve, tmp_path):
    with pytest.raises(ValueError, match="missing.jinja' looks like a file name"):
        serve("--chat-template", str(tmp_path / "missing.jinja"))
