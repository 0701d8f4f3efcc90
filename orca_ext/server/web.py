"""The pages for people: the chat at ``/`` and the live engine dashboard at ``/dashboard``.

Both are static files inside the package (``web/``: HTML, CSS and plain JavaScript, no build
step, nothing fetched from elsewhere), read once when the app is made and served from memory
under ``/ui/``. The chat talks to ``/v1/chat/completions``; the dashboard reads
``/dashboard/events`` (``dashboard.DashboardFeed``). With an API key, the pages are public
but both APIs need the key, which the pages ask for once and keep in the browser.
"""
from __future__ import annotations

from collections.abc import Callable
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from .core import ServingCore
from .dashboard import DashboardFeed

_MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
                ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}
# Only this origin's files and connections: a flaw in the Markdown renderer still could not
# run a script from a reply, nor load anything from elsewhere.
_SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
PAGES = {"/": "chat.html", "/dashboard": "dashboard.html"}


def load_assets() -> dict[str, tuple[bytes, str]]:
    """Every file of the package's ``web/`` folder: name -> (bytes, media type)."""
    folder = resources.files(__package__).joinpath("web")
    assets = {}
    for entry in folder.iterdir():
        suffix = entry.name[entry.name.rfind("."):]
        if entry.is_file() and suffix in _MEDIA_TYPES:
            assets[entry.name] = (entry.read_bytes(), _MEDIA_TYPES[suffix])
    missing = set(PAGES.values()) - assets.keys()
    if missing:
        raise FileNotFoundError(f"the web UI's files are missing from {folder}: "
                                f"{', '.join(sorted(missing))}")
    return assets


def add_web_routes(app: FastAPI, core: ServingCore) -> None:
    """``/``, ``/dashboard``, ``/ui/<file>`` and ``/dashboard/events`` (not in the OpenAPI
    document: they are pages, not API)."""
    assets = load_assets()
    feed = DashboardFeed(core)

    def serve(name: str) -> Response:
        body, media_type = assets[name]
        return Response(body, media_type=media_type, headers=_SECURITY_HEADERS)

    def page(name: str) -> Callable[[], Response]:
        def endpoint() -> Response:  # no parameters: FastAPI would read them from the query
            return serve(name)
        return endpoint

    for path, name in PAGES.items():
        app.add_api_route(path, page(name), methods=["GET"], include_in_schema=False)

    @app.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in assets:
            return Response(status_code=404)
        return serve(name)

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events(request: Request) -> Response:
        core.check_api_key(request.headers.get("authorization"))
        return StreamingResponse(feed.events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})
