"""GET / and /playground: a page to chat on a session and see what the cache did for each turn.

Plain HTML, JavaScript and CSS shipped in the package (server/http/playground/): no CDN, no build step. The
page calls only the public API, with the key the user types (kept in the browser); the page and its files
need no key themselves (they hold no tenant's data). KVSERVE_PLAYGROUND=false leaves all of it out.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

ASSETS = files("server.http") / "playground"
STATIC = "/playground/static"
OPEN_PATHS = frozenset({"/", "/playground"})
# The page loads its own files and calls this server's API; nothing inline, nothing from elsewhere.
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def install(app: FastAPI) -> None:
    router = APIRouter(include_in_schema=False)

    @router.get("/")
    @router.get("/playground")
    async def page() -> FileResponse:
        return FileResponse(
            str(ASSETS / "index.html"), media_type="text/html", headers={"Content-Security-Policy": POLICY}
        )

    app.include_router(router)
    app.mount(STATIC, StaticFiles(directory=str(ASSETS)), name="playground-static")
