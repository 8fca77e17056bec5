"""The web page at `/`: a playground and a live dashboard, static files shipped inside the package
(vllmlite/api/ops/static/), served as they are: no build step, no CDN, plain JavaScript.

Owns the routes `GET /` and `GET /static/{name}` and the list of files they may serve. The page holds
no data: it is public, and the API calls it makes carry the key the user types into it. Knows nothing
of the engine; the page reads the JSON endpoints (/v1/stats, /debug/*) like any other client.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from starlette.responses import Response

from vllmlite.api.errors import APIError
from vllmlite.api.openapi import route_doc

STATIC_PREFIX = "/static/"
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8"}
# The page is public, but a browser must not cache an old app.js across a server upgrade unseen.
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


def is_page_path(path: str) -> bool:
    """The page's own paths, which the API key does not guard: `/` and one file under /static/.

    >>> is_page_path("/"), is_page_path("/static/app.js"), is_page_path("/static/../v1/models")
    (True, True, False)
    """
    if path == "/":
        return True
    name = path.removeprefix(STATIC_PREFIX)
    return name != path and "/" not in name and name not in ("", ".", "..")


def load_static_files() -> dict[str, bytes]:
    """Every file of the page by name, read once: the routes serve only these names, so no path a
    client sends ever reaches the filesystem."""
    folder = resources.files("vllmlite.api.ops") / "static"
    return {entry.name: entry.read_bytes() for entry in folder.iterdir()
            if entry.is_file() and "." + entry.name.rsplit(".", 1)[-1] in MEDIA_TYPES}


def add_web_routes(app: FastAPI) -> None:
    files = load_static_files()

    @app.get("/", response_class=Response, **_text_doc("text/html"))
    async def page() -> Response:
        return _file_response(files, "index.html")

    # text/html too: a client that normalizes /static/.. asks for the page itself.
    @app.get(STATIC_PREFIX + "{name}", response_class=Response,
             **_text_doc("text/javascript", "text/css", "text/html", errors=(404,)))
    async def static(name: str) -> Response:
        if name not in files:
            raise APIError(404, "no such file among the page's static files")
        return _file_response(files, name)


def _text_doc(*media_types: str, errors: tuple[int, ...] = ()) -> dict:
    """route_doc for a route answering text in any of `media_types`."""
    doc = route_doc({"type": "string"}, media_type=media_types[0], errors=errors)
    doc["responses"][200]["content"] = {media_type: {"schema": {"type": "string"}} for media_type in media_types}
    if 404 in errors:
        doc["responses"][404]["description"] = "No such file"
    return doc


def _file_response(files: dict[str, bytes], name: str) -> Response:
    media_type = MEDIA_TYPES["." + name.rsplit(".", 1)[-1]]
    return Response(files[name], media_type=media_type, headers=HEADERS)
