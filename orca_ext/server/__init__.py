"""Serving: an OpenAI-compatible HTTP API and a gRPC API over one ``AsyncEngine``.

``orca-serve`` (or ``python -m orca_ext.server``) runs both; in code::

    app = create_app(engine, model_name="orca-tiny")            # a FastAPI app
    server, port = await start_grpc_server(engine, "127.0.0.1", 0)

Pass one ``ServingCore`` to both to share the API key, queue bound and metrics. Needs the
``serve`` extra (fastapi, uvicorn, prometheus_client, grpcio, protobuf, jinja2).
"""
from __future__ import annotations

from typing import Any

__all__ = ["APIError", "ServingCore", "create_app", "start_grpc_server"]


def __getattr__(name: str) -> Any:  # lazy: ``import orca_ext.server`` stays cheap
    if name == "create_app":
        from .http import create_app
        return create_app
    if name == "start_grpc_server":
        from .grpc_server import start_grpc_server
        return start_grpc_server
    if name == "ServingCore":
        from .core import ServingCore
        return ServingCore
    if name == "APIError":
        from .protocol import APIError
        return APIError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
