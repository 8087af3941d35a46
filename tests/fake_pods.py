"""Fake OpenAI-compatible vLLM pods with scripted /metrics, for end-to-end tests.

    python tests/fake_pods.py 9001 9002 9003

Each port is one pod. Tests script a pod's metrics with POST /_control/metrics, how it answers with
POST /_control/behaviour ({"fail": n, "delay": s, "chunks": n, "chunk_delay": s}; {"release": true} ends
every delay under way at once) and read which models it served with GET /_control/requests.
A request in its scripted delay is reported as running on top of the scripted metrics, as vLLM reports
the requests it is computing: a scrape sees the requests a proxy sent there.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

BASE_MODEL = "meta-llama/Llama-2-7b-hf"


def metrics_page(state: dict, in_flight: int = 0) -> str:
    running = ",".join(state.get("running_adapters", []))
    waiting = ",".join(state.get("waiting_adapters", []))
    labels = f'model_name="{BASE_MODEL}"'
    return "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} {float(state.get('running', 0) + in_flight)}",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{labels}}} {float(state.get('waiting', 0))}",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{labels}}} {float(state.get('kv', 0.0))}",
        "# TYPE vllm:lora_requests_info gauge",
        f'vllm:lora_requests_info{{max_lora="{state.get("max_lora", 4)}",running_lora_adapters="{running}",'
        f'waiting_lora_adapters="{waiting}"}} {time.time()}',
        *([f'vllm:cache_config_info{{block_size="16",enable_prefix_caching="True",num_gpu_blocks="{blocks}"}} 1.0']
          if (blocks := state.get("num_gpu_blocks")) else []),
        "",
    ])


def make_app(port: int) -> Starlette:
    state: dict = {"metrics": {}, "requests": [], "raw": None, "behaviour": {}, "release": asyncio.Event(),
                   "in_flight": 0}

    async def metrics(_: Request):
        if state["raw"] is not None:
            return PlainTextResponse(state["raw"])
        return PlainTextResponse(metrics_page(state["metrics"], state["in_flight"]))

    async def set_metrics(request: Request):
        body = await request.json()
        state["raw"] = body.pop("raw", None)
        state["metrics"] = body
        return JSONResponse({"ok": True})

    async def set_behaviour(request: Request):
        state["behaviour"] = await request.json()
        if state["behaviour"].pop("release", False):
            state["release"].set()
            state["release"] = asyncio.Event()
        return JSONResponse({"ok": True})

    async def requests(_: Request):
        return JSONResponse(state["requests"])

    async def reset(_: Request):
        state["requests"].clear()
        return JSONResponse({"ok": True})

    async def completion(request: Request):
        body = await request.json()
        model = body.get("model")
        state["requests"].append(model)
        print(port, model, time.time(), flush=True)
        chat = request.url.path.endswith("/chat/completions")
        behaviour = state["behaviour"]
        if behaviour.get("fail", 0) > 0:
            behaviour["fail"] -= 1
            return JSONResponse({"error": {"message": "scripted failure", "type": "server_error"}}, status_code=500)
        state["in_flight"] += 1
        try:
            await asyncio.wait_for(state["release"].wait(), behaviour.get("delay", 0))
        except asyncio.TimeoutError:
            pass
        finally:
            state["in_flight"] -= 1
        if body.get("stream"):
            async def chunks():
                for i in range(behaviour.get("chunks", 3)):
                    delta = {"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}
                    obj = "chat.completion.chunk" if chat else "text_completion"
                    yield f"data: {json.dumps({'id': 'x', 'object': obj, 'model': model, 'choices': [{'index': 0, **delta, 'finish_reason': None}]})}\n\n"
                    await asyncio.sleep(behaviour.get("chunk_delay", 0.01))
                yield "data: [DONE]\n\n"
            return StreamingResponse(chunks(), media_type="text/event-stream")
        choice = ({"message": {"role": "assistant", "content": f"served by {port}"}} if chat
                  else {"text": f"served by {port}"})
        return JSONResponse({
            "id": "cmpl-1", "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "finish_reason": "stop", **choice}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
        })

    async def models(_: Request):
        return JSONResponse({"object": "list", "data": [{"id": BASE_MODEL, "object": "model"}]})

    async def health(_: Request):
        return PlainTextResponse("")

    return Starlette(routes=[
        Route("/metrics", metrics),
        Route("/_control/metrics", set_metrics, methods=["POST"]),
        Route("/_control/behaviour", set_behaviour, methods=["POST"]),
        Route("/_control/requests", requests),
        Route("/_control/reset", reset, methods=["POST"]),
        Route("/v1/completions", completion, methods=["POST"]),
        Route("/v1/chat/completions", completion, methods=["POST"]),
        Route("/v1/models", models),
        Route("/health", health),
    ])


async def serve(ports: list[int]) -> None:
    servers = [uvicorn.Server(uvicorn.Config(make_app(p), host="127.0.0.1", port=p, log_level="warning"))
               for p in ports]
    await asyncio.gather(*(s.serve() for s in servers))


if __name__ == "__main__":
    asyncio.run(serve([int(p) for p in sys.argv[1:]]))
