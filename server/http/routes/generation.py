"""The generation routes, one per API spec (server/serving/apis.py): POST a body, get its turn's answer."""

from __future__ import annotations

import inspect
import time
from typing import Any

from fastapi import APIRouter, Depends, Request

from server.http import deps
from server.serving.apis import APIS, ApiSpec
from server.serving.core import SESSION_HEADER, Serving
from server.serving.pipeline import Arrival, run_turn

router = APIRouter()


def endpoint(api: ApiSpec) -> Any:
    """The route's function, its body typed as the spec's model (FastAPI validates it and documents it)."""

    async def create(body: Any, request: Request, serving: Serving, tenant: str) -> Any:
        request.state.model = body.model  # the failure series' label, should it be refused
        arrival = Arrival(tenant, request.headers.get(SESSION_HEADER), api.new_id(), int(time.time()))
        turn = api.read(body, arrival)
        if turn.named is not None and not turn.named.is_bucket:
            request.state.session = turn.named.name  # the access log names it, whatever the answer
        return await run_turn(serving, turn, request)

    parameter = inspect.Parameter
    create.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            parameter("body", parameter.POSITIONAL_OR_KEYWORD, annotation=api.body),
            parameter("request", parameter.POSITIONAL_OR_KEYWORD, annotation=Request),
            parameter("serving", parameter.KEYWORD_ONLY, default=Depends(deps.serving), annotation=Serving),
            parameter("tenant", parameter.KEYWORD_ONLY, default=Depends(deps.tenant), annotation=str),
        ]
    )
    create.__name__ = api.name
    return create


for api in APIS:
    router.add_api_route(api.path, endpoint(api), methods=["POST"], summary=api.summary, tags=list(api.tags) or None)
