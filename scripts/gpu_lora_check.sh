#!/usr/bin/env bash
# LoRA on a GPU machine in one run: build orca_ext with the CUDA kernels (sm_90), run
# lora_linear's CUDA tests, then a tiny Llama with two adapters and the base in one batch on
# CUDA against the CPU (greedy tokens, float32 and bfloat16).
#   OUT=/path bash scripts/gpu_lora_check.sh        # build.log, pytest.log, engine.log in OUT
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_results}
mkdir -p "$OUT"
export ORCA_EXT_CUDA=ON TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
python3 -m pip install --no-build-isolation --no-deps . -Cbuild-dir=build-gpu >"$OUT/build.log" 2>&1 \
  || python3 -m pip install --no-build-isolation --no-deps . -Cbuild-dir=build-gpu \
       --break-system-packages >>"$OUT/build.log" 2>&1 \
  || { echo "BUILD FAILED"; tail -n 40 "$OUT/build.log"; exit 1; }
echo "built in ${SECONDS}s"
RUN=$(mktemp -d) && cd "$RUN"
python3 -m pytest -q -p no:cacheprovider "$ROOT/tests/test_lora_linear.py" -k cuda \
  >"$OUT/pytest.log" 2>&1; echo "pytest rc=$?"; tail -n 3 "$OUT/pytest.log"
ROOT=$ROOT python3 - >"$OUT/engine.log" 2>&1 <<'PYEOF'
import os, sys, tempfile
from pathlib import Path
import torch, transformers
sys.path.insert(0, os.path.join(os.environ["ROOT"], "bench"))
from lora import write_adapter
from orca_ext import LLM, LoRARequest, SamplingParams
from orca_ext.model import byte_level_tokenizer, load_model

tmp = Path(tempfile.mkdtemp())
torch.manual_seed(0)
transformers.LlamaForCausalLM(transformers.LlamaConfig(
    vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.1, bos_token_id=None, eos_token_id=None)).save_pretrained(tmp / "base")
byte_level_tokenizer(["<|endoftext|>"]).save(tmp / "base" / "tokenizer.json")
model = load_model(str(tmp / "base")).model
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
loras = []
for i in range(2):
    write_adapter(tmp / f"a{i}", model, 8, targets, seed=i)
    loras.append(LoRARequest(f"a{i}", i + 1, str(tmp / f"a{i}")))
prompts = [[5, 9, 100, 42, 7] * (i + 1) for i in range(4)]
which = [loras[0], None, loras[1], loras[0]]
params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
ok = True
for dtype in ("float32", "bfloat16"):
    out = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(tmp / "base"), dtype=dtype, device=device, enable_lora=True, max_loras=2)
        out[device] = [o.outputs[0].token_ids for o in
                       llm.generate(prompts, params, use_tqdm=False, lora_request=which)]
    same = [a == b for a, b in zip(out["cpu"], out["cuda"])]
    if dtype == "float32":
        lora32 = out["cuda"]
    print(dtype, "cuda == cpu per request:", same)
    ok &= all(same) or dtype == "bfloat16"
base = LLM(str(tmp / "base"), dtype="float32", device="cuda")
plain = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
print("adapters change the tokens:", [a != b for a, b in zip(lora32, plain)])
print("ENGINE OK" if ok else "ENGINE MISMATCH")
PYEOF
echo "engine rc=$?"; tail -n 6 "$OUT/engine.log"
