"""The FastAPI application: routes, API-key check and OpenAI-style errors.

Every error is ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad field (named in
``param``), 401 for a missing or wrong API key, 404 for an unknown model, 503 (with
``Retry-After``) when the waiting queue is full, the server is shutting down or the engine has
stopped; 500 (same body) when the engine failed under the request.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedspec.engine.core.processor import PromptType
from pagedspec.engine.sampling_params import SamplingParams
from pagedspec.engine.serve.async_engine import AsyncEngine
from pagedspec.engine.serve.chat import Chat, chat_params, chat_prompt, max_tokens_field
from pagedspec.engine.serve.completions import Completions, completion_params, completion_prompts
from pagedspec.engine.serve.metrics import ServerMetrics
from pagedspec.engine.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from pagedspec.engine.serve.request_group import RequestGroup
from pagedspec.engine.serve.serving import APIError, api_error, bad_request, check_context
from pagedspec.engine.serve.sse import ClientDisconnected, EventStreamResponse, unless_disconnected


def create_app(engine: AsyncEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The app around a not-yet-started ``AsyncEngine``: startup starts its thread, shutdown
    (after the server's drain, ``pagedspec.engine.serve.graceful``) aborts what is left and stops
    it."""
    metrics = ServerMetrics(lambda: engine.stats)
    tokenizer, max_model_len = engine.engine.tokenizer, engine.engine.max_model_len
    completions, chat = Completions(tokenizer, model_name), Chat(tokenizer, model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="pagedspec", lifespan=lifespan)

    def error_response(error: APIError) -> JSONResponse:
        metrics.rejected.labels(status=str(error.status)).inc()
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, error: APIError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        if first.get("type") == "json_invalid":  # loc is ("body", the offset): not a field
            at = first.get("loc", ("body", "?"))[-1]
            reason = first.get("ctx", {}).get("error", "not JSON")
            message = f"invalid JSON at position {at}: {reason}"
            return error_response(APIError(400, message, code="invalid_json"))
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return error_response(APIError(400, message, param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "NotFoundError" if error.status_code == 404 else "InvalidRequestError"
        return error_response(APIError(error.status_code, str(error.detail), kind))

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        """The API key, before anything else about a /v1 request (its body included)."""
        if api_key is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                denied = APIError(
                    401, "missing or invalid API key", "AuthenticationError", code="invalid_api_key"
                )
                return error_response(denied)
        return await call_next(request)

    def check_model(model: str | None) -> None:
        if model is not None and model != model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{model_name}`.",
                "NotFoundError",
                param="model",
                code="model_not_found",
            )

    async def start(
        prompts: list[PromptType], params: SamplingParams, renamed: dict[str, str], priority: int
    ) -> RequestGroup:
        try:
            return await RequestGroup.start(engine, metrics, prompts, params, priority)
        except ValueError as e:
            raise bad_request(e, renamed) from None
        except Exception as e:  # noqa: BLE001 - queue full, shutting down
            raise api_error(e) from None

    async def respond(request: Request, group: RequestGroup, stream: bool, content, full):
        """A streamed response, or the whole one unless the client leaves first."""
        if stream:
            return EventStreamResponse(content(), on_close=group.close)
        try:
            return await unless_disconnected(request.receive, full())
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - the engine failed or stopped under this request
            raise api_error(e) from None
        finally:
            group.close()

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        check_model(body.model)
        params = completion_params(body)
        prompts = completion_prompts(tokenizer, body.prompt)
        lens = [len(p["prompt_token_ids"]) for p in prompts if not isinstance(p, str)]
        check_context(max_model_len, lens, params.max_tokens, "max_tokens")
        group = await start(prompts, params, body.renamed_fields(), body.priority)
        return await respond(
            request,
            group,
            body.stream,
            lambda: completions.stream(group, body, params),
            lambda: completions.full(group, body, params),
        )

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        params = chat_params(body)
        renamed = {"prompt": "messages", "logprobs": "top_logprobs"} | body.renamed_fields()
        prompt = chat_prompt(tokenizer, body)
        lens = [len(prompt["prompt_token_ids"])]
        check_context(max_model_len, lens, params.max_tokens, max_tokens_field(body))
        group = await start([prompt], params, renamed, body.priority)
        return await respond(
            request,
            group,
            body.stream,
            lambda: chat.stream(group, body),
            lambda: chat.full(group, body),
        )

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=engine.engine.max_model_len)])

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
