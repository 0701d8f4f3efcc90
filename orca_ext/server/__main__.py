"""``orca-serve`` / ``python -m orca_ext.server``: the OpenAI-compatible HTTP server (FastAPI +
uvicorn) and, with ``--grpc-port``, the gRPC server, both in one event loop over one engine."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from .. import envs

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes: ``1073741824``, ``512MiB``, ``2GiB``, ``1.5G`` (K/M/G/T are powers of 1024;
    ``KB``/``MB``/``GB``/``TB`` powers of 1000)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 2GiB, 512MiB)")
    number, unit, suffix = match.groups()
    power = " kmgt".index(unit.lower() or " ")
    base = 1000 if suffix.lower() == "b" and unit else 1024
    return int(float(number) * base ** power)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a port: {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from ..scheduler import POLICIES

    p = argparse.ArgumentParser(
        prog="orca-serve", description="Serve a model over an OpenAI-compatible HTTP API "
        "(and gRPC with --grpc-port). Options named as vLLM's mean what they mean there.")
    m = p.add_argument_group("model")
    m.add_argument("--model", default="smollm2-135m-instruct",
                   help="a built-in name (smollm2-135m-instruct, orca-tiny), a Hugging Face "
                        "model folder or a GGUF file (default: smollm2-135m-instruct)")
    m.add_argument("--served-model-name", default=None,
                   help="the name clients use in 'model' (default: --model)")
    m.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help="the chat template (Jinja, as in a Hugging Face tokenizer_config.json): "
                   "a file, or the template's text (backslash escapes such as \\n decoded); "
                   "replaces the model's own. Without either, chat requests are refused (400)")
    m.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 where the CPU has AMX or AVX512-BF16, else float32), "
                        "float32, float16 or bfloat16")
    m.add_argument("--quantization", default=None, choices=["none", "q8_0", "q4_0", "q4_1"],
                   help="none (dequantize), or q8_0 / q4_0 / q4_1: quantize every linear weight "
                        "at load (default: a GGUF file runs in its stored formats, other models "
                        "unquantized); quantized models run float32 under --dtype auto")
    m.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when "
                   "available)")
    m.add_argument("--max-model-len", type=_positive, default=None,
                   help="the longest context (prompt + output) in tokens, at most the model's "
                   "(default: the model's); a longer prompt is refused with 400")
    m.add_argument("--seed", type=int, default=None,
                   help="seed for the draws of requests that set no seed of their own "
                   "(default: torch's fixed start state)")
    s = p.add_argument_group("scheduling")
    s.add_argument("--policy", default="orca", choices=sorted(POLICIES),
                   help="scheduling policy (default orca)")
    s.add_argument("--max-num-seqs", "--max-batch-size", dest="max_batch_size", type=_positive,
                   default=32, metavar="MAX_NUM_SEQS",
                   help="most requests in one iteration (default 32)")
    s.add_argument("--max-num-batched-tokens", type=_positive, default=None,
                   help="per-iteration token budget (paged policy only)")
    s.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM\'s: {"method": "ngram", '
                   '"num_speculative_tokens": 4} or {"method": "draft_model", "model": NAME, '
                   '"num_speculative_tokens": 4} (docs/serving.md)')
    s.add_argument("--max-queue", type=_positive, default=None,
                   help="refuse new requests (429) while this many wait for admission")
    kv = p.add_argument_group("KV cache")
    size = kv.add_mutually_exclusive_group()
    size.add_argument("--kv-cache-tokens", type=_positive, default=None,
                      help="KV cache size in tokens (default: max-num-seqs full contexts)")
    size.add_argument("--kv-cache-memory", type=parse_size, default=None,
                      help="KV cache size in bytes, e.g. 4GiB")
    kv.add_argument("--block-size", type=_positive, default=16, help="KV block size in tokens")
    kv.add_argument("--kv-cache-dtype", default="auto",
                    choices=["auto", "int8", "fp8", "fp8_e4m3"],
                    help="auto: the activations' dtype; int8 (CPU): per token and head scales, "
                    "about 4x the tokens of float32 in the same memory; fp8 / fp8_e4m3 (CUDA): "
                    "float8 e4m3 values, 2x the tokens of bfloat16")
    kv.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                    default=None, help="reuse the KV of cached prompt prefixes (default: on for "
                    "the orca and paged policies; the request policy cannot)")
    lora = p.add_argument_group("LoRA adapters")
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve LoRA adapters: a request's model field names one")
    lora.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[],
                      metavar="NAME=PATH", help="adapters to serve from the start (PEFT folders)")
    lora.add_argument("--max-loras", type=_positive, default=1,
                      help="adapters one batch may use (default 1)")
    lora.add_argument("--max-lora-rank", type=_positive, default=16,
                      help="the highest adapter rank accepted (default 16)")
    lora.add_argument("--max-cpu-loras", type=_positive, default=None,
                      help="adapters whose tensors stay in memory (default --max-loras)")
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      help="add POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    srv = p.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: "
                     "127.0.0.1; 0.0.0.0 for all interfaces)")
    srv.add_argument("--port", type=_port, default=8000,
                     help="HTTP port (default 8000; 0: pick a free one)")
    srv.add_argument("--grpc-port", type=_port, default=None,
                     help="also serve gRPC on this port (0: pick a free one)")
    srv.add_argument("--max-body-bytes", type=parse_size, default=4 << 20,
                     help="largest request body (default 4MiB; larger: 413)")
    srv.add_argument("--stuck-timeout", type=float, default=300.0,
                     help="seconds one engine step may take before /health reports 503")
    srv.add_argument("--log-level", default="info",
                     choices=["critical", "error", "warning", "info", "debug", "trace"])
    srv.add_argument("--disable-log-requests", action="store_true",
                     help="no info line per finished request (id, prompt and output tokens, "
                     "time to first token, total time, finish reason)")
    sec = p.add_argument_group("security")
    sec.add_argument("--api-key", default=envs.ORCA_API_KEY,
                     help="require 'Authorization: Bearer <key>' on /v1 and gRPC (default: "
                     "$ORCA_API_KEY; none)")
    sec.add_argument("--ssl-certfile", default=None, help="serve HTTPS (and gRPC over TLS)")
    sec.add_argument("--ssl-keyfile", default=None, help="the certificate's private key")
    d = p.add_argument_group("distributed (docs/distributed.md)")
    d.add_argument("--tensor-parallel-size", "--tp", type=_positive, default=1,
                   help="split each layer over this many workers (default 1)")
    d.add_argument("--pipeline-parallel-size", "--pp", type=_positive, default=1,
                   help="split the layers into this many pipeline stages (default 1)")
    d.add_argument("--pipeline-layers", type=_int_list, default=None,
                   help="layers per stage, e.g. 3,5 (default: an even split)")
    d.add_argument("--worker-threads", type=_positive, default=None,
                   help="CPU threads per worker (default: cores / workers on the node)")
    d.add_argument("--nnodes", type=_positive, default=1, help="machines taking part (default 1)")
    d.add_argument("--node-rank", type=int, default=0,
                   help="this machine's rank; node 0 runs the engine and the server, the others "
                   "only workers")
    d.add_argument("--master-addr", default="127.0.0.1",
                   help="node 0's address, reachable from every node (default 127.0.0.1)")
    d.add_argument("--master-port", type=_port, default=None,
                   help="rendezvous port on node 0 (default: 29500 with several nodes, else free)")
    return p


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}")


def _parallel_config(args: argparse.Namespace) -> Any:
    from ..distributed import ParallelConfig

    port = args.master_port
    if port is None:
        port = 29500 if args.nnodes > 1 else 0
    return ParallelConfig(args.tensor_parallel_size, args.pipeline_parallel_size,
                          args.pipeline_layers, args.nnodes, args.node_rank, args.master_addr,
                          port, args.worker_threads)


class _UvicornServer:
    """uvicorn.Server without its own signal handling (``main`` installs handlers that stop it,
    then shuts down gRPC and the engine before the process exits)."""

    def __new__(cls, config):  # subclass lazily: uvicorn is an optional dependency
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

            def install_signal_handlers(self) -> None:  # uvicorn < 0.29
                pass

        return Server(config)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _summary(engine: Any, chat_template: str) -> list[str]:
    """The banner's lines: the model (``engine.info``) and how the engine runs it."""
    from ..kv import kv_bytes_per_block

    info, scheduler = engine.info, engine.scheduler.config
    describe = getattr(engine.executor, "describe", None)
    if describe is not None:  # a distributed engine: this process holds no weights
        return [*describe(), f"policy {scheduler.policy}, max batch size "
                f"{scheduler.max_batch_size}, {scheduler.num_batches_in_flight} batches in flight"]
    config, model = info.config, engine.executor.model
    params = sum(p.numel() for p in model.parameters())
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    allocator = engine.scheduler.allocator
    kv_dtype = engine.executor.kv_cache.dtype
    kv_bytes = kv_bytes_per_block(config, allocator.block_size, kv_dtype) * allocator.num_blocks
    return [
        f"model: {config.architecture}, {config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_heads} heads ({config.num_kv_heads} KV), vocab {config.vocab_size}, "
        f"{params / 1e6:.1f}M parameters, {str(dtype).removeprefix('torch.')} on "
        f"{engine.executor.device}, context {info.max_model_len} tokens"
        f", chat template: {chat_template}",
        f"KV cache: {allocator.num_blocks} blocks x {allocator.block_size} tokens = "
        f"{allocator.num_blocks * allocator.block_size} tokens, "
        f"{str(kv_dtype).removeprefix('torch.')}, {kv_bytes / 2**20:.1f} MiB; "
        f"policy {scheduler.policy}, max batch size {scheduler.max_batch_size}, prefix caching "
        f"{'on' if scheduler.enable_prefix_caching else 'off'}",
    ]


async def _serve(args: argparse.Namespace, core: Any, http_sock: socket.socket,
                 banner: list[str]) -> None:
    import uvicorn

    from .grpc_server import start_grpc_server
    from .http import create_app

    app = create_app(core)
    config = uvicorn.Config(app, log_level=args.log_level, ssl_certfile=args.ssl_certfile,
                            ssl_keyfile=args.ssl_keyfile, timeout_graceful_shutdown=5,
                            timeout_keep_alive=30, server_header=False)
    server = _UvicornServer(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # Windows
            loop.add_signal_handler(sig, server.handle_exit, sig, None)
    grpc_server = None
    scheme = "https" if args.ssl_certfile else "http"
    host, port = http_sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    lines = [*banner, f"HTTP listening on {scheme}://{shown}:{port} (OpenAI API under /v1; "
             f"/health, /metrics; chat at /, engine dashboard at /dashboard)"]
    if args.grpc_port is not None:
        grpc_server, grpc_port = await start_grpc_server(
            core, args.host, args.grpc_port, ssl_certfile=args.ssl_certfile,
            ssl_keyfile=args.ssl_keyfile)
        lines.append(f"gRPC listening on {shown}:{grpc_port}"
                     f"{' (TLS)' if args.ssl_certfile else ''} (service orca.v1.Orca)")
    for line in lines:
        print(f"orca-serve: {line}", flush=True)
    try:
        await server.serve(sockets=[http_sock])
    finally:
        if grpc_server is not None:
            await grpc_server.stop(grace=2)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        print("orca-serve: error: --ssl-certfile and --ssl-keyfile go together", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if args.log_level == "trace"
                        else args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        parallel = _parallel_config(args)
    except ValueError as exc:
        print(f"orca-serve: error: {exc}", file=sys.stderr)
        return 2
    if parallel.node_rank > 0:  # workers only: node 0 runs the engine and the server
        from ..distributed import run_node

        return run_node(parallel)
    try:
        import fastapi  # noqa: F401
        import grpc  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        print(f"orca-serve: error: {exc.name} is missing; install the server dependencies with "
              "pip install 'orca_ext[serve]'", file=sys.stderr)
        return 2

    from ..distributed import WorkerError

    try:
        http_sock = _bind(args.host, args.port)
    except OSError as exc:
        print(f"orca-serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        core, banner = build_core(args, parallel)
    except (ValueError, FileNotFoundError, OSError, WorkerError) as exc:
        http_sock.close()
        print(f"orca-serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(args, core, http_sock, banner))
    except ValueError as exc:
        print(f"orca-serve: error: {exc}", file=sys.stderr)
        return 2
    finally:
        http_sock.close()
        core.engine.shutdown()
    return 0


def build_core(args: argparse.Namespace, parallel: Any) -> tuple[Any, list[str]]:
    """The engine (``build_engine``) and ``ServingCore`` that ``args`` describe (``parallel``: their
    ``ParallelConfig``), and the banner lines saying what they are. Bad arguments raise
    ValueError (or the loader's FileNotFoundError / OSError, or WorkerError)."""
    import torch

    from ..async_engine import AsyncEngine
    from ..build import build_engine
    from ..chat import load_chat_template
    from ..config import EngineConfig
    from .core import ServingCore
    from .protocol import APIError

    if args.seed is not None and parallel.enabled:
        raise ValueError("--seed does not reach distributed workers (they sample); give each "
                         "request a seed instead")
    chat_template = load_chat_template(args.chat_template)  # before the slow load: fail fast
    if (args.lora_modules or args.allow_runtime_lora_updating) and not args.enable_lora:
        raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    config = EngineConfig(args.model, dtype=args.dtype, device=args.device,
                          max_model_len=args.max_model_len, max_batch_size=args.max_batch_size,
                          policy=args.policy, max_num_batched_tokens=args.max_num_batched_tokens,
                          block_size=args.block_size, kv_cache_tokens=args.kv_cache_tokens,
                          kv_cache_memory=args.kv_cache_memory,
                          enable_prefix_caching=args.enable_prefix_caching,
                          parallel_config=parallel if parallel.enabled else None,
                          quantization=args.quantization,
                          speculative_config=args.speculative_config,
                          kv_cache_dtype=args.kv_cache_dtype, enable_lora=args.enable_lora,
                          max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                          max_cpu_loras=args.max_cpu_loras)
    engine = build_engine(config)
    if args.seed is not None:  # after the build, so that the first request starts from it
        torch.manual_seed(args.seed)
    async_engine = AsyncEngine(engine, stuck_timeout=args.stuck_timeout)
    try:
        core = ServingCore(async_engine, args.served_model_name or args.model,
                           chat_template=chat_template, api_key=args.api_key,
                           max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                           log_requests=not args.disable_log_requests,
                           allow_runtime_lora_updating=args.allow_runtime_lora_updating)
        for name, path in args.lora_modules:
            core.load_lora(name, path)
    except APIError as exc:
        async_engine.shutdown()
        raise ValueError(f"--lora-modules: {exc.message}") from None
    except ValueError:
        async_engine.shutdown()
        raise
    source = "--chat-template" if chat_template is not None else \
        "the model's" if engine.info.chat_template is not None else \
        "none (chat requests get 400)"
    return core, _summary(engine, source)


if __name__ == "__main__":
    sys.exit(main())
