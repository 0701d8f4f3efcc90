"""LoRA on tiny random models of several families against transformers + peft: the per-op path
(a prefill batch mixing adapters and the base) and the fused DecoderStack (the decode step after
it, one stack call), float32 logits row by row; the stack against the per-op blocks in
bfloat16; and Phi-3's fused checkpoint projections (qkv_proj, gate_up_proj)."""
from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

from tiny_models import VOCAB, make_hf_model, save_hf_model  # noqa: E402

from orca_ext import LoRARequest  # noqa: E402
from orca_ext.kv import KVCache, build_metadata  # noqa: E402
from orca_ext.lora.manager import LoRAManager  # noqa: E402
from orca_ext.model import load_model  # noqa: E402
from orca_ext.model.layers import AttentionMetadata  # noqa: E402
from orca_ext.runner.decoder_stack import (build_decoder_stack, set_stack_lora,  # noqa: E402
                                           stack_forward)

TARGETS = {
    "llama_gqa": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen3": ["q_proj", "v_proj", "down_proj"],
    "gemma3": ["k_proj", "o_proj", "gate_proj", "up_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
}
PROMPTS = [[5, 9, 100, 42, 7], [11, 3, 250, 8], [60, 61, 62, 63, 64, 65]]
NEXT = [17, 23, 99]  # the decode step's tokens
BLOCK = 4


@pytest.fixture(scope="module", params=list(TARGETS))
def family(request, tmp_path_factory):
    """(our model folder, two peft models sharing its weights, their adapter folders)."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    folder = save_hf_model(make_hf_model(name), root / "base")
    peft_models, paths = [], []
    for i, rank in enumerate((4, 8)):
        torch.manual_seed(10 + i)
        model = peft.get_peft_model(make_hf_model(name), peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=TARGETS[name],
            init_lora_weights=False, use_rslora=i == 1)).eval()
        model.save_pretrained(str(root / f"a{i}"))
        peft_models.append(model)
        paths.append(str(root / f"a{i}"))
    return folder, peft_models, paths


def prepare(folder, paths, dtype, quantization=None):
    loaded = load_model(str(folder), dtype, quantization=quantization)
    manager = LoRAManager(loaded.model, 2, 8, 2)
    for slot, path in enumerate(paths):
        manager.add(LoRARequest(f"a{slot}", slot + 1, path))
        manager.activate(slot, slot + 1)
    return loaded, manager


def run_steps(loaded, manager, slots: list[int], fused_decode: bool):
    """Logits of the prefill rows (per-op) and of the decode step (stack or per-op)."""
    kv = KVCache(loaded.config, 16, BLOCK, loaded.dtype, "cpu")
    block_ids = [[0, 1], [2, 3], [4, 5]]
    lora_slots = torch.tensor(slots, dtype=torch.int32)
    lengths = [len(p) for p in PROMPTS]
    results = []
    with torch.inference_mode():
        for step, (ids, done, new) in enumerate((
                ([t for p in PROMPTS for t in p], [0, 0, 0], lengths),
                (NEXT, lengths, [1, 1, 1]))):
            cu, ctx, table, slot_mapping, positions = build_metadata(block_ids, done, new, BLOCK)
            meta = AttentionMetadata(cu, ctx, table, slot_mapping)
            input_ids = torch.tensor(ids)
            if step == 1 and fused_decode:
                stack = build_decoder_stack(loaded.model)
                set_stack_lora(stack, loaded.model, manager.linears, manager.batch.scales)
                hidden = stack_forward(loaded.model, stack, input_ids, positions, kv, meta,
                                       lora_slots=lora_slots)
            else:
                manager.set_step(cu, lora_slots)
                try:
                    hidden = loaded.model(input_ids, positions, kv, meta)
                finally:
                    manager.clear_step()
            results.append(loaded.model.compute_logits(hidden, torch.arange(len(ids))))
    return results


def test_prefill_and_fused_decode_match_peft(family):
    folder, peft_models, paths = family
    loaded, manager = prepare(folder, paths, torch.float32)
    slots = [1, -1, 0]  # adapter a1, the base, adapter a0
    prefill, decode = run_steps(loaded, manager, slots, fused_decode=True)
    start = 0
    for r, (prompt, slot) in enumerate(zip(PROMPTS, slots)):
        ids = torch.tensor([prompt + [NEXT[r]]])
        with torch.no_grad():
            if slot < 0:
                with peft_models[0].disable_adapter():
                    want = peft_models[0](ids).logits[0]
            else:
                want = peft_models[slot](ids).logits[0]
        got = prefill[start:start + len(prompt)]
        torch.testing.assert_close(got, want[:-1], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(decode[r], want[-1], atol=2e-4, rtol=1e-4)
        start += len(prompt)
    with torch.no_grad(), peft_models[1].disable_adapter():
        base = peft_models[1](torch.tensor([PROMPTS[0]])).logits[0]
    assert (base - prefill[:len(PROMPTS[0])]).abs().max() > 1e-2  # the adapter did something


def test_fused_decode_matches_per_op_bfloat16(family):
    folder, _, paths = family
    loaded, manager = prepare(folder, paths, torch.bfloat16)
    slots = [0, 1, -1]
    _, per_op = run_steps(loaded, manager, slots, fused_decode=False)
    _, fused = run_steps(loaded, manager, slots, fused_decode=True)
    # Same kernels but the up linear's activation (the stack's own, after the delta).
    assert (fused - per_op).abs().max() <= 0.05 * per_op.abs().max()


def test_fused_decode_matches_per_op_quantized(family):
    """Linears holding q8_0 blocks: the stack's quantized kernels, then the same deltas."""
    folder, _, paths = family
    loaded, manager = prepare(folder, paths, torch.float32, quantization="q8_0")
    slots = [1, 0, -1]
    _, per_op = run_steps(loaded, manager, slots, fused_decode=False)
    _, fused = run_steps(loaded, manager, slots, fused_decode=True)
    # The int8 kernels (avx512_vnni, amx_int8) round activations: a last-bit difference in a
    # linear's input (the delta added in another order) may move one rounding, ~1e-4 here.
    torch.testing.assert_close(fused, per_op, atol=5e-4, rtol=1e-4)


def test_stack_lora_errors(family):
    folder, _, paths = family
    loaded, manager = prepare(folder, paths, torch.float32)
    stack = build_decoder_stack(loaded.model)
    kv = KVCache(loaded.config, 4, BLOCK, torch.float32, "cpu")
    cu, ctx, table, slot_mapping, positions = build_metadata([[0]], [0], [1], BLOCK)
    args = (torch.zeros(1, loaded.config.hidden_size), kv.keys, kv.values, cu, ctx, table,
            slot_mapping, None, None)
    with pytest.raises(RuntimeError, match="set_lora first"):
        stack.forward_lora(*args, torch.tensor([0], dtype=torch.int32))
    set_stack_lora(stack, loaded.model, manager.linears, manager.batch.scales)
    with pytest.raises(RuntimeError, match=r"lora_slots\[0\] = 2 is outside \[-1, 2\)"):
        stack.forward_lora(*args, torch.tensor([2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="lora_slots has 2 entries"):
        stack.forward_lora(*args, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="one entry per layer"):
        stack.set_lora([], manager.batch.scales)
