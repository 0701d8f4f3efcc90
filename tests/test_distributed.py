"""Distributed execution on CPU: gloo over 127.0.0.1, one thread per worker, tiny models.

Greedy outputs are the same with TP=2, PP=2 and TP=2 x PP=2 as in one process; a 2-stage
pipeline holds 2 batches in flight; a killed worker fails its requests (and /health) instead of
hanging and leaves no process; weights load sharded straight from the checkpoint; and the
two-node example of docs/distributed.md runs over loopback.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time

import gguf
import pytest
import torch

from orca_ext.async_engine import AsyncEngine, EngineDeadError
from orca_ext.distributed import ParallelConfig, WorkerError
from orca_ext.distributed.sharded_load import build_meta_model, load_shards
from orca_ext.distributed.tensor_parallel import (ROW, VOCAB, Split, param_split, shard_tensor,
                                                  tp_plan)
from orca_ext import LLM, EngineConfig, build_engine
from orca_ext.model import load_model, load_model_info
from orca_ext.sampling_params import SamplingParams, StructuredOutputsParams
from gguf_files import make_model as make_gguf_model
from gguf_files import write_gguf
from tiny_models import make_hf_model, save_hf_model

PROMPTS = [[72, 101, 108, 108, 111], list(range(40, 80)), [7], [200, 13, 56, 91, 3, 17, 250]]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
ENGINE_ARGS = dict(dtype="float32", max_batch_size=2, kv_cache_tokens=1024, block_size=8)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return save_hf_model(make_hf_model("llama_gqa"), tmp_path_factory.mktemp("llama_gqa"))


def _worker_children() -> list[int]:
    """Processes this one started that are (or were: zombies) distributed workers."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if int(ppid) == os.getpid() and (state == "Z" or b"orca_ext.distributed" in cmdline):
            found.append(int(entry))
    return found


def _outputs(llm: LLM, params=GREEDY) -> list[tuple[list[int], list | None]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs)
            for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _reference(model: str, params=GREEDY) -> list[tuple[list[int], list | None]]:
    return _outputs(LLM(load_model(model), **ENGINE_ARGS), params)


def _distributed(model: str, tp: int, pp: int, **parallel) -> LLM:
    return LLM(model, **ENGINE_ARGS, parallel_config=ParallelConfig(tp, pp, worker_threads=1,
                                                                    **parallel))


# --- in-process pieces -------------------------------------------------------------------------


def test_stage_split_and_model_checks():
    three = ParallelConfig(pipeline_parallel_size=3)
    assert three.stage_layers(8) == [range(0, 3), range(3, 6), range(6, 8)]
    assert ParallelConfig(pipeline_parallel_size=2, pipeline_layers=[3, 5]).stage_layers(8) == [
        range(0, 3), range(3, 8)]
    config = load_model_info("orca-tiny").config
    with pytest.raises(ValueError, match="num_attention_heads"):
        ParallelConfig(tensor_parallel_size=3).check_model(config)
    with pytest.raises(ValueError, match="add up to 7"):
        ParallelConfig(pipeline_parallel_size=2, pipeline_layers=[3, 4]).check_model(config)
    with pytest.raises(ValueError, match="more than the model's 8 layers"):
        ParallelConfig(pipeline_parallel_size=9).check_model(config)
    with pytest.raises(ValueError, match="nnodes"):
        ParallelConfig(tensor_parallel_size=3, nnodes=2, master_port=29500)
    with pytest.raises(ValueError, match="master_port"):
        ParallelConfig(tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="loaded model"):
        build_engine(EngineConfig(load_model("orca-tiny"), tensor_parallel_size=2))


def test_shards_reassemble_the_full_tensor():
    full = torch.randn(12, 6)
    qkv = Split("column", (4, 4, 4))
    shards = [shard_tensor(full, qkv, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([s.view(3, 2, 6) for s in shards], 1).view(12, 6), full)
    rows = [shard_tensor(full, ROW, r, 3) for r in range(3)]
    assert torch.equal(torch.cat(rows, 1), full)
    vocab = [shard_tensor(full[:11], VOCAB, r, 2) for r in range(2)]  # 11 rows: one padded
    assert [v.shape[0] for v in vocab] == [6, 6] and not vocab[1][-1].any()
    assert torch.equal(torch.cat(vocab)[:11], full[:11])
    plan = tp_plan(load_model_info("orca-tiny").config)
    assert param_split(plan, "layers.3.attn.out.bias").kind == "replicate"
    assert param_split(plan, "layers.3.attn.qkv.bias").kind == "column"


@pytest.mark.parametrize("name", ["orca-tiny", "gpt2", "llama_gqa", "gemma3", "gguf_llama",
                                  "gguf_gpt2", "gguf_gemma3"])
def test_shards_load_straight_from_the_checkpoint(name, tmp_path):
    """Each rank's shards equal the slices of the single-process weights (GPT-2's transposed
    Conv1D, Llama's fused q/k/v and gate/up parts, the padded vocab, orca-tiny's random init,
    Gemma's shifted norms, a GGUF file's quantized tensors)."""
    if name == "orca-tiny":
        model = name
    elif name.startswith("gguf_"):
        arch = name.removeprefix("gguf_")
        model = str(write_gguf(make_gguf_model(arch), arch, tmp_path / "m.gguf",
                               gguf.GGMLQuantizationType.Q8_0))
    else:
        model = str(save_hf_model(make_hf_model(name), tmp_path))
    full = dict(load_model(model, quantization="none").model.named_parameters())
    info = load_model_info(model)
    plan = tp_plan(info.config)
    for rank in range(2):
        meta = build_meta_model(info.config, torch.float32, "cpu")
        keep = (lambda n: not n.startswith("layers.1.")) if rank else (lambda n: True)
        load_shards(meta, info, keep, rank, 2, torch.float32, "cpu")
        for param_name, param in meta.named_parameters():
            if param.is_meta:
                assert param_name.startswith("layers.1.") and rank == 1
                continue
            expected = shard_tensor(full[param_name], param_split(plan, param_name), rank, 2)
            assert torch.equal(param, expected), param_name


# --- worker processes ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_expected():
    return _reference("orca-tiny")


@pytest.fixture(scope="module")
def llama_expected(llama_folder):
    return _reference(str(llama_folder))


@pytest.mark.slow
def test_orca_tiny_tp2_same_greedy_outputs(tiny_expected):
    with _distributed("orca-tiny", 2, 1) as llm:
        assert [ids for ids, _ in _outputs(llm)] == [ids for ids, _ in tiny_expected]
    assert not _worker_children()


@pytest.fixture(scope="class")
def llm():
    """orca-tiny on 2 pipeline stages, split 3 + 5 layers (the stage-to-layer map overridden).
    A driver process runs one distributed engine at a time: this one lives for one class."""
    with _distributed("orca-tiny", 1, 2, pipeline_layers=(3, 5)) as llm:
        yield llm
    assert not _worker_children()


@pytest.mark.slow
class TestOrcaTinyPipeline:
    def test_same_outputs(self, llm, tiny_expected):
        assert [ids for ids, _ in _outputs(llm)] == [ids for ids, _ in tiny_expected]
        # Pipelining changes no arithmetic: seeded sampling and logprobs match exactly too, from
        # an engine that has run the same prompts before (its prefix cache holds them too).
        seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=5, logprobs=2)
        reference = LLM(load_model("orca-tiny"), **ENGINE_ARGS)
        _outputs(reference)
        assert _outputs(llm, seeded) == _outputs(reference, seeded)

    def test_structured_outputs(self, llm):
        """A batch's grammar masks reach the last stage with it (filled, then pickled): the
        constrained outputs equal one process's."""
        params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=(
            StructuredOutputsParams(regex="[a-f]{3}-[0-9]{2,6}")))
        got = _outputs(llm, params)
        assert got == _reference("orca-tiny", params)
        assert all(re.fullmatch("[a-f]{3}-[0-9]{2,6}", bytes(t for t in ids if t < 256).decode())
                   for ids, _ in got)  # orca-tiny: token id = byte, then specials

    def test_holds_two_batches_in_flight(self, llm):
        """4 requests, at most 2 per batch: the engine submits the second batch while the first
        is still in the pipeline, and the executor takes it at once."""
        executor = llm.engine.executor
        assert executor.num_batches_in_flight == 2
        assert llm.engine.scheduler.config.num_batches_in_flight == 2
        executor.max_batches_in_flight = 0
        _outputs(llm)
        assert executor.max_batches_in_flight == 2


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_llama_gqa_same_greedy_outputs(llama_folder, llama_expected, tp, pp):
    with _distributed(str(llama_folder), tp, pp) as llm:
        assert [ids for ids, _ in _outputs(llm)] == [ids for ids, _ in llama_expected]
        if tp * pp == 4:
            assert len(llm.engine.executor.workers.pids) == 4
    assert not _worker_children()


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_new_families_same_greedy_outputs(family, tp, pp, tmp_path):
    """QK norms, post norms (all-reduced before the norm), scaled embeddings (a later stage
    receives them scaled), sliding windows and two rotary tables, sharded and staged."""
    folder = str(save_hf_model(make_hf_model(family), tmp_path))
    expected = _reference(folder)
    with _distributed(folder, tp, pp) as llm:
        assert [ids for ids, _ in _outputs(llm)] == [ids for ids, _ in expected]
    assert not _worker_children()


@pytest.mark.slow
def test_worker_startup_failure_is_reported(tmp_path):
    folder = save_hf_model(make_hf_model("gpt2"), tmp_path)
    from safetensors.torch import load_file, save_file
    tensors = load_file(folder / "model.safetensors")
    del tensors["transformer.h.1.mlp.c_fc.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WorkerError, match=r"stage 1.*lacks tensors.*h\.1\.mlp\.c_fc\.weight"):
        _distributed(str(folder), 1, 2)
    assert not _worker_children()


@pytest.mark.slow
def test_killed_worker_fails_requests_cleanly():
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from orca_ext.server import create_app

    engine = build_engine(EngineConfig("orca-tiny", **ENGINE_ARGS,
                                       parallel_config=ParallelConfig(1, 2, worker_threads=1)))
    executor = engine.executor
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine)

    async def health() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return (await client.get("/health")).status_code

    async def consume(prompt: list[int], started: asyncio.Event) -> None:
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        async for _ in async_engine.generate(prompt, params):
            started.set()

    async def main() -> tuple[int, int, list]:
        before = await health()
        started = [asyncio.Event(), asyncio.Event()]
        tasks = [asyncio.create_task(consume(p, s)) for p, s in zip(PROMPTS, started)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
        os.kill(executor.workers.pids[2], signal.SIGKILL)  # the last stage, mid-run
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        return before, await health(), results

    try:
        before, after, results = asyncio.run(main())
        assert (before, after) == (200, 503)
        for result in results:
            assert isinstance(result, EngineDeadError)
            assert "worker rank 2 (stage 1, TP rank 0) exited with code -9" in str(result)
        deadline = time.monotonic() + 10  # the other worker is killed at once
        while executor.workers.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert executor.workers.alive() == []
        with pytest.raises(WorkerError, match="exited with code -9"):
            engine.executor.submit(None)
    finally:
        async_engine.shutdown()
    assert not _worker_children()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_node_example_over_loopback(tiny_expected):
    """docs/distributed.md: node 1 runs workers only, node 0 the engine, server and workers."""
    pytest.importorskip("fastapi")
    from server_helpers import ServerProcess, _die_with_parent

    from orca_ext.detokenizer import TokenText

    port = str(_free_port())
    # float32 as the single-process reference (the default, auto, is bfloat16 on some CPUs).
    common = ["--model", "orca-tiny", "--dtype", "float32", "--tp", "2", "--pp", "2",
              "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port,
              "--worker-threads", "1"]
    node1 = subprocess.Popen([sys.executable, "-m", "orca_ext.server", *common,
                              "--node-rank", "1"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, preexec_fn=_die_with_parent)
    server = None
    try:
        server = ServerProcess(*common, "--node-rank", "0").start()
        assert "TP 2 x PP 2 = 4 workers on cpu, 2 node(s)" in server.output()
        with server.client() as client:
            body = {"model": "orca-tiny", "prompt": PROMPTS[1], "max_tokens": 5,
                    "temperature": 0, "logprobs": 0}
            choice = client.post("/v1/completions", json=body).json()["choices"][0]
        token_text = TokenText(load_model_info("orca-tiny").tokenizer)
        assert choice["logprobs"]["tokens"] == [token_text(t) for t in tiny_expected[1][0]]
        assert server.stop() == 0
        assert node1.wait(60) == 0, node1.stdout.read()
    finally:
        if server is not None:
            server.stop()
        if node1.poll() is None:
            node1.kill()
            node1.wait(10)


# --- GPUs (bench/gpu_check.sh) -------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)],
                         ids=["1worker", "tp2", "pp2", "tp2xpp2"])
def test_cuda_same_greedy_outputs(tp, pp):
    """One worker per GPU, NCCL for the data plane."""
    import orca_ext

    if not (torch.cuda.is_available() and orca_ext.has_cuda()):
        pytest.skip("needs a GPU and a CUDA build of orca_ext")
    if torch.cuda.device_count() < tp * pp:
        pytest.skip(f"needs {tp * pp} GPUs")
    expected = _outputs(LLM(load_model("orca-tiny", device="cuda"), **ENGINE_ARGS))
    parallel = ParallelConfig(tp, pp, worker_threads=1)
    with LLM("orca-tiny", device="cuda", **ENGINE_ARGS, parallel_config=parallel) as llm:
        assert [ids for ids, _ in _outputs(llm)] == [ids for ids, _ in expected]
    assert not _worker_children()
