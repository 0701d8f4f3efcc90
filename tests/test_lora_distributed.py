"""LoRA adapters on distributed engines (gloo on CPU, one thread per worker, a tiny Llama with
GQA): greedy outputs of a mix of adapters and the base at TP=2, PP=2 and TP=2 x PP=2 equal one
process's, before and after adapters are unloaded and loaded through the control plane (each
worker reads its own share); an adapter's shares add up to the whole; a bad adapter is refused
by the driver with nothing changed; and an adapter unloaded and replaced under its id is not
served the old one's cached prefix blocks."""
from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

from test_distributed import ENGINE_ARGS, PROMPTS, _worker_children  # noqa: E402
from tiny_models import make_hf_model, save_hf_model  # noqa: E402

from orca_ext import LLM, LoRARequest, SamplingParams  # noqa: E402
from orca_ext.distributed import ParallelConfig  # noqa: E402
from orca_ext.distributed.sharded_load import build_meta_model  # noqa: E402
from orca_ext.lora.adapter import load_adapter  # noqa: E402
from orca_ext.lora.shard import AdapterShard  # noqa: E402
from orca_ext.model import load_model, load_model_info  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LORA_ARGS = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
ADAPTERS = {  # name -> (rank, rsLoRA, target modules)
    "all4": (4, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]),
    "qvd8": (8, True, ["q_proj", "v_proj", "down_proj"]),
    "kog6": (6, False, ["k_proj", "o_proj", "gate_proj", "up_proj"]),
    "big16": (16, False, ["q_proj"]),  # above max_lora_rank
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The base model's folder and each adapter's (random PEFT adapters, nonzero B)."""
    root = tmp_path_factory.mktemp("lora_tp")
    base = save_hf_model(make_hf_model("llama_gqa"), root / "base")
    adapters = {}
    for seed, (name, (rank, rslora, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        model = peft.get_peft_model(make_hf_model("llama_gqa"), peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, use_rslora=rslora, target_modules=targets,
            init_lora_weights=False))
        model.save_pretrained(str(root / name))
        adapters[name] = str(root / name)
    return str(base), adapters


def _request(folders, name: str, lora_int_id: int) -> LoRARequest:
    return LoRARequest(name, lora_int_id, folders[1][name])


def _session(llm: LLM, folders) -> list[list[list[int]]]:
    """Greedy outputs of two generate calls mixing adapters and the base, with adapter 1
    ("all4") unloaded between them and "kog6" loaded under its id."""
    a, b = _request(folders, "all4", 1), _request(folders, "qvd8", 2)
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[a, a, None, b])
    llm.engine.remove_lora(1)
    c = _request(folders, "kog6", 1)
    llm.engine.add_lora(c)
    second = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[b, c, None, c])
    return [[o.outputs[0].token_ids for o in outs] for outs in (first, second)]


@pytest.fixture(scope="module")
def expected(folders):
    """One process's outputs of ``_session`` (its prefix cache on: the second call's prompts
    were all run before; the 40-token one's blocks cached under "all4")."""
    llm = LLM(load_model(folders[0]), **ENGINE_ARGS, **LORA_ARGS)
    return _session(llm, folders)


def test_adapters_change_the_outputs(folders, expected):
    """The session's adapters matter: each one's outputs differ from the base's."""
    llm = LLM(load_model(folders[0]), **ENGINE_ARGS)
    base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    first, second = expected
    assert first[2] == base[2] and second[2] == base[2]
    for outputs in (first, second):
        for prompt in (0, 1, 3):
            assert outputs[prompt] != base[prompt]


def test_replaced_adapter_misses_the_old_ones_cached_blocks(folders, expected):
    """After "all4" is unloaded and "kog6" loaded under its id, "kog6"'s outputs are those of an
    engine that never saw "all4", though "all4" had run the same 40-token prompt (its blocks
    cached)."""
    llm = LLM(load_model(folders[0]), **ENGINE_ARGS, **LORA_ARGS)
    c = _request(folders, "kog6", 1)
    fresh = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[None, c, None, c])
    second = expected[1]
    assert [second[1], second[3]] == [fresh[1].outputs[0].token_ids, fresh[3].outputs[0].token_ids]


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)], ids=["tp2", "tp2xpp2"])
def test_shares_add_up_to_the_whole_adapter(folders, tp, pp):
    """Every worker's share of an adapter, put together as the TP plan splits the base linears,
    is the whole adapter: the column-parallel linears' B columns rank by rank in each section
    (q / k / v, gate / up) and A whole; the row-parallel linears' A columns rank by rank and B
    whole; each stage keeps its own layers, renumbered from 0."""
    config = load_model_info(folders[0]).config
    reference = build_meta_model(config, torch.float32, "cpu")
    whole = load_adapter(_request(folders, "all4", 1), reference, 8)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    sections = {"attn.qkv": (q, kv, kv), "mlp.up": (config.intermediate_size,) * 2}
    stages = [range(0, 1), range(1, 2)] if pp == 2 else [range(0, 2)]
    for stage in stages:
        shares = [AdapterShard(reference, stage, rank, tp).take(whole) for rank in range(tp)]
        for share in shares:
            assert set(share.deltas) == {f"layers.{i}.{name}" for i in range(len(stage))
                                         for name in ("attn.qkv", "attn.out", "mlp.up",
                                                      "mlp.down")}
        for local, layer in enumerate(stage):
            for name in ("attn.qkv", "mlp.up", "attn.out", "mlp.down"):
                full = whole.deltas[f"layers.{layer}.{name}"]
                parts = [share.deltas[f"layers.{local}.{name}"] for share in shares]
                if name in sections:
                    assert all(torch.equal(p.a, full.a) for p in parts)
                    pieces, start = [], 0
                    for size in sections[name]:
                        pieces += [p.b_t[:, start:start + size // tp] for p in parts]
                        start += size // tp
                    assert start == parts[0].b_t.shape[1]
                    assert torch.equal(torch.cat(pieces, dim=1), full.b_t)
                else:
                    assert all(torch.equal(p.b_t, full.b_t) for p in parts)
                    assert torch.equal(torch.cat([p.a for p in parts], dim=1), full.a)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_same_greedy_outputs_as_one_process(folders, expected, tp, pp):
    with LLM(folders[0], **ENGINE_ARGS, **LORA_ARGS,
             parallel_config=ParallelConfig(tp, pp, worker_threads=1)) as llm:
        assert _session(llm, folders) == expected
        # Bad adapters are refused by the driver, naming the problem; nothing changes.
        known = llm.engine.list_loras()
        with pytest.raises(ValueError, match="rank 16 is above max_lora_rank 8"):
            llm.engine.add_lora(LoRARequest("big", 3, folders[1]["big16"]))
        with pytest.raises(ValueError, match="is not a folder"):
            llm.engine.add_lora(LoRARequest("missing", 4, folders[1]["all4"] + "-missing"))
        assert llm.engine.list_loras() == known
        again = llm.generate([PROMPTS[3], PROMPTS[0]], GREEDY, use_tqdm=False,
                             lora_request=_request(folders, "qvd8", 2))
        first, second = expected
        assert [o.outputs[0].token_ids for o in again] == [first[3], second[0]]
    assert not _worker_children()
