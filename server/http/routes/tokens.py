"""POST /tokenize and /detokenize (vLLM's names and shapes)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from server.http import deps
from server.openai.formats import DetokenizeRequest, TokenizeRequest
from server.serving.tokens import Tokens

router = APIRouter(tags=["tokens"])


@router.post("/tokenize", summary="A prompt's token ids: text as is, or messages through the chat template")
async def tokenize(body: TokenizeRequest, tokens: Tokens = Depends(deps.tokens)) -> dict:
    return await tokens.tokenize(body)


@router.post("/detokenize", summary="Token ids back to text")
async def detokenize(body: DetokenizeRequest, tokens: Tokens = Depends(deps.tokens)) -> dict:
    return await tokens.detokenize(body)
