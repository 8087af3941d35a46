"""A hosted OpenAI-compatible API that is not a pod (no /metrics), for end-to-end tests.

    python tests/hosted_api.py PORT KEY

Every /v1 route wants `Authorization: Bearer KEY` (401 otherwise, as OpenAI answers), under any one
path segment too (`/eu/v1/...`: several deployments of one provider). A model whose name starts with
"slow" answers after 3 s; one that starts with "fail" gets a 500. GET /_control/requests lists
(path, model, authorized); GET /_control/other lists (path, Authorization header) of every other request,
/metrics included (404, as a hosted provider answers).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

SLOW_S = 3.0


def make_app(key: str) -> Starlette:
    seen: list[tuple[str, str, bool]] = []
    other: list[tuple[str, str | None]] = []

    async def answer(request: Request):
        body = await request.json()
        chat = request.url.path.endswith("/chat/completions")
        authorized = request.headers.get("authorization") == f"Bearer {key}"
        seen.append((request.url.path, body.get("model", ""), authorized))
        if not authorized:
            return JSONResponse({"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                                           "code": "invalid_api_key"}}, status_code=401)
        if str(body.get("model", "")).startswith("slow"):
            await asyncio.sleep(SLOW_S)
        if str(body.get("model", "")).startswith("fail"):
            return JSONResponse({"error": {"message": "upstream failure", "type": "server_error"}}, status_code=500)
        words = ["Hello", " from", " the", " hosted", " API"]
        created, model = int(time.time()), body.get("model", "")
        if body.get("stream"):
            async def events():
                for word in words:
                    delta = {"delta": {"content": word}} if chat else {"text": word}
                    chunk = {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion",
                             "created": created, "model": model,
                             "choices": [{"index": 0, "finish_reason": None, **delta}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        text = "".join(words)
        choice = ({"message": {"role": "assistant", "content": text}} if chat else {"text": text, "logprobs": None})
        usage = {"prompt_tokens": 3, "completion_tokens": len(words), "total_tokens": 3 + len(words)}
        return JSONResponse({"id": "x", "object": "chat.completion" if chat else "text_completion", "created": created,
                             "model": model, "choices": [{"index": 0, "finish_reason": "stop", **choice}],
                             "usage": usage})

    async def requests(_: Request):
        return JSONResponse(seen)

    async def others(_: Request):
        return JSONResponse(other)

    async def anything_else(request: Request):
        other.append((request.url.path, request.headers.get("authorization")))
        return JSONResponse({"error": "not found"}, status_code=404)

    return Starlette(routes=[Route("/v1/completions", answer, methods=["POST"]),
                             Route("/v1/chat/completions", answer, methods=["POST"]),
                             Route("/{tenant}/v1/completions", answer, methods=["POST"]),
                             Route("/{tenant}/v1/chat/completions", answer, methods=["POST"]),
                             Route("/_control/requests", requests), Route("/_control/other", others),
                             Route("/{path:path}", anything_else, methods=["GET", "POST"])])


if __name__ == "__main__":
    uvicorn.run(make_app(sys.argv[2]), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
