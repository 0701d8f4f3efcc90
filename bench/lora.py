"""LoRA serving throughput: Orca's offline workload over many adapters in one packed batch,
against the same requests on the base model only, against merging each adapter into the
weights and serving its requests on their own (what serving without a segmented LoRA op does),
and against transformers + peft serving the same adapters.

    python bench/lora.py [--model smollm2-135m-instruct] [--quantization none]
                         [--num-requests 32] [--num-adapters 8] [--rank 16]
                         [--targets q_proj k_proj v_proj o_proj gate_proj up_proj down_proj]
                         [--max-batch-size 16] [--prompt-len 32 512] [--output-len 1 128]

Random adapters in PEFT's format (nonzero A and B) are written to a temporary folder; requests
take them round-robin. Prints output tokens/s of each way and the ratios. ``--quantization
none`` (the default) dequantizes the base so that the merged baseline can add B @ A to its
weights and transformers can load it; pass ``--quantization ''`` to run the GGUF's stored
formats (neither baseline then). transformers + peft (``--no-peft`` skips it) runs the
dequantized weights with every adapter loaded into one ``PeftModel``, static batches of
``--max-batch-size`` requests in arrival order, each batch's rows on their own adapters (peft's
mixed-adapter batches: ``generate(..., adapter_names=[...])``), left-padded, ``max_new_tokens``
= the batch's longest output; only each request's own output length counts.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from orca_ext import LLM, LoRARequest, SamplingParams
from orca_ext.lora.adapter import linear_parts
from orca_ext.model import load_model

_SHORT = {"self_attn": "", "mlp": ""}


def write_adapter(folder: Path, model: torch.nn.Module, rank: int, targets: list[str],
                  seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, part in linear_parts(model).items():
        if module.rsplit(".", 1)[-1] not in targets:
            continue
        linear = model.get_submodule(part.linear)
        in_features = getattr(linear, "in_features", None) or linear.weight.shape[1]
        prefix = f"base_model.model.{module}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) \
            / in_features ** 0.5
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(part.rows, rank, generator=gen) * 0.02
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": targets}))


def workload(args: argparse.Namespace, vocab_size: int):
    rng = random.Random(args.seed)
    prompts, params = [], []
    for _ in range(args.num_requests):
        prompts.append([rng.randrange(vocab_size) for _ in range(rng.randint(*args.prompt_len))])
        params.append(SamplingParams(temperature=0, ignore_eos=True,
                                     max_tokens=rng.randint(*args.output_len)))
    return prompts, params


def timed(fn, repeats: int = 2) -> float:
    """The best of ``repeats`` runs (the first also warms caches and allocators)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def peft_model(loaded, requests: list[LoRARequest]):
    """transformers on ``loaded``'s float weights, with every adapter of ``requests`` loaded
    (named by its ``lora_name``)."""
    import peft
    import transformers

    from orca_ext.model.loader import save_pretrained_folder

    with tempfile.TemporaryDirectory() as folder:
        save_pretrained_folder(loaded, folder)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=loaded.dtype)
    model = peft.PeftModel.from_pretrained(model, requests[0].lora_path,
                                           adapter_name=requests[0].lora_name)
    for r in requests[1:]:
        model.load_adapter(r.lora_path, adapter_name=r.lora_name)
    return model.eval()


@torch.inference_mode()
def peft_generate(model, prompts: list[list[int]], params: list[SamplingParams],
                  adapter_names: list[str], batch_size: int, pad_id: int) -> list[list[int]]:
    """Static batches in arrival order, each row with its own adapter; each request's output."""
    outputs = []
    for i in range(0, len(prompts), batch_size):
        chunk = range(i, min(i + batch_size, len(prompts)))
        width = max(len(prompts[j]) for j in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, j in enumerate(chunk):  # left padding
            ids[row, width - len(prompts[j]):] = torch.tensor(prompts[j])
            mask[row, width - len(prompts[j]):] = 1
        new = max(params[j].max_tokens for j in chunk)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=pad_id,
                             adapter_names=[adapter_names[j] for j in chunk])
        outputs += [out[row, width:width + params[j].max_tokens].tolist()
                    for row, j in enumerate(chunk)]
    return outputs


def merge(model: torch.nn.Module, adapter, sign: float) -> None:
    """Add (or take back) ``scale * B @ A`` of every adapted linear into its weight."""
    with torch.no_grad():
        for name, delta in adapter.deltas.items():
            weight = model.get_submodule(name).weight
            weight.add_((sign * adapter.scale) * (delta.b_t.t() @ delta.a).to(weight.dtype))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="none",
                        help="'none' dequantizes the base; '' runs the stored formats")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", nargs="+", default=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512])
    parser.add_argument("--output-len", type=int, nargs=2, default=[1, 128])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-peft", action="store_true",
                        help="skip the transformers + peft baseline")
    args = parser.parse_args()
    quantization = args.quantization or None

    loaded = load_model(args.model, args.dtype, "cpu", quantization)
    prompts, params = workload(args, loaded.config.vocab_size)
    num_output = sum(p.max_tokens for p in params)
    kv_tokens = args.max_batch_size * (args.prompt_len[1] + args.output_len[1])
    common = dict(max_batch_size=args.max_batch_size, kv_cache_tokens=kv_tokens,
                  enable_prefix_caching=False)
    print(f"{args.model} ({quantization or 'stored formats'}, {args.dtype}), "
          f"{args.num_requests} requests ({sum(map(len, prompts))} prompt + {num_output} output "
          f"tokens) over {args.num_adapters} adapters of rank {args.rank} on "
          f"{', '.join(args.targets)}; {torch.get_num_threads()} threads")
    warm = [prompts[0][:16]], SamplingParams(temperature=0, max_tokens=4)
    with tempfile.TemporaryDirectory() as tmp:
        requests = []
        for i in range(args.num_adapters):
            write_adapter(Path(tmp) / f"a{i}", loaded.model, args.rank, args.targets, seed=i)
            requests.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        loras = [requests[i % len(requests)] for i in range(len(prompts))]

        seconds = {}
        base = LLM(loaded, **common)
        base.generate(*warm, use_tqdm=False)
        seconds["base model only"] = timed(lambda: base.generate(prompts, params, use_tqdm=False))
        del base
        lora = LLM(loaded, enable_lora=True, max_loras=args.num_adapters,
                   max_lora_rank=args.rank, **common)
        for r in requests:  # read every adapter once, as a server's --lora-modules does
            lora.engine.add_lora(r)
        lora.generate(*warm, use_tqdm=False, lora_request=requests[0])
        ours: list = []
        seconds["LoRA, one packed batch"] = timed(lambda: ours.append(
            lora.generate(prompts, params, use_tqdm=False, lora_request=loras)))
        ours = [list(o.outputs[0].token_ids) for o in ours[-1]]
        adapters = [lora.engine.lora._adapter(r.lora_int_id) for r in requests]
        del lora
        if quantization == "none":
            merged = LLM(loaded, **common)
            merged.generate(*warm, use_tqdm=False)

            def per_adapter() -> None:
                for i, adapter in enumerate(adapters):
                    mine = [j for j in range(len(prompts)) if j % len(adapters) == i]
                    merge(loaded.model, adapter, 1.0)
                    merged.generate([prompts[j] for j in mine], [params[j] for j in mine],
                                    use_tqdm=False)
                    merge(loaded.model, adapter, -1.0)

            seconds["merged per adapter"] = timed(per_adapter)
        if quantization == "none" and not args.no_peft:
            model = peft_model(loaded, requests)
            pad_id = loaded.info.eos_token_ids[0] if loaded.info.eos_token_ids else 0
            names = [r.lora_name for r in loras]
            peft_generate(model, [prompts[0][:16]], [warm[1]], names[:1], 1, pad_id)
            theirs: list = []
            seconds["transformers + peft"] = timed(lambda: theirs.append(peft_generate(
                model, prompts, params, names, args.max_batch_size, pad_id)))
            same = sum(a == b for a, b in zip(ours, theirs[-1]))
            print(f"transformers + peft: {same} of {len(ours)} requests' greedy tokens equal ours")
            del model
    base_rate = num_output / seconds["base model only"]
    for name, s in seconds.items():
        rate = num_output / s
        print(f"{name:<24} {s:7.2f} s  {rate:8.1f} output tok/s  {rate / base_rate:5.2f}x base")
    if "transformers + peft" in seconds:
        print(f"LoRA in one packed batch: "
              f"{seconds['transformers + peft'] / seconds['LoRA, one packed batch']:.2f}x "
              "transformers + peft's output tokens/s")


if __name__ == "__main__":
    main()
