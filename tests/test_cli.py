"""orca-generate: offline generation from the command line."""
from __future__ import annotations

import json

import pytest

from orca_ext.cli import main
from orca_ext.llm import LLM
from orca_ext.sampling_params import SamplingParams


def test_generate_prints_the_llm_api_outputs(capsys):
    assert main(["--model", "orca-tiny", "--prompt", "hello", "--prompt", "ab", "--max-tokens",
                 "5", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    greedy = SamplingParams(max_tokens=5, temperature=0)
    expected = LLM("orca-tiny").generate(["hello", "ab"], greedy, use_tqdm=False)
    assert [line["prompt"] for line in lines] == ["hello", "ab"]
    assert [line["token_ids"] for line in lines] == [list(o.outputs[0].token_ids)
                                                     for o in expected]
    assert all(line["finish_reason"] == "length" for line in lines)


def test_bad_input_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--prompt", "x", "--max-tokens", "0"])
    assert exit_info.value.code == 2
    assert "max_tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", "/no/such/folder", "--prompt", "x"])


def test_the_default_model_answers_a_chat_question(capsys):
    """No --model: the built-in SmolLM2-135M-Instruct, the prompt sent through its chat
    template, stopped at its end-of-turn token."""
    assert main(["--prompt", "What is the capital of France?", "--dtype", "float32",
                 "--max-tokens", "24", "--json"]) == 0
    [line] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "Paris" in line["text"]
    assert line["finish_reason"] == "stop"


def test_chat_template_flag(capsys):
    """orca-tiny has no chat template: --chat is refused until --chat-template gives one."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "orca-tiny", "--prompt", "hi", "--chat"])
    assert exit_info.value.code == 2
    assert "no chat template" in capsys.readouterr().err
    assert main(["--model", "orca-tiny", "--prompt", "hi", "--max-tokens", "4", "--json",
                 "--chat-template", "<{{ messages[0]['content'] }}>"]) == 0
    [line] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    greedy = SamplingParams(max_tokens=4, temperature=0)
    [expected] = LLM("orca-tiny").generate(["<hi>"], greedy, use_tqdm=False)
    assert line["token_ids"] == list(expected.outputs[0].token_ids)
