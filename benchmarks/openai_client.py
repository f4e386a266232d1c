"""One timed request to any OpenAI-compatible server (``/v1/completions`` or
``/v1/chat/completions``, streamed over server-sent events or not), over httpx.

Times follow vLLM's ``bench serve``: TTFT is send to the first chunk with text, ITL the gaps
between chunks with text, end-to-end latency send to the end of the response.
"""

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    status: int = 0  # HTTP status; 0: no response (connection failed or the client gave up)
    ttft_s: float | None = None
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int | None = None
    output_tokens: int = 0  # the server's usage count, else the chunks with text
    finish_reason: str | None = None
    error: str | None = None
    disconnected: bool = False  # the client closed the stream on purpose

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and not self.disconnected


class SSEDecoder:
    """Server-sent events, line by line: ``line()`` returns an event's data once its blank line
    arrives (several ``data:`` lines joined by newlines), else None; comments and other fields
    are skipped."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def line(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:
            data, self._data = self._data, []
            return "\n".join(data) if data else None
        if line.startswith("data:"):
            self._data.append(line[5:].removeprefix(" "))
        return None

    def flush(self) -> str | None:
        """The last event of a stream that ended without its blank line."""
        return self.line("")


def chunk_text(chunk: dict) -> str:
    """The text in a completion or chat chunk / response (first choice)."""
    choices = chunk.get("choices") or [{}]
    c = choices[0]
    if "text" in c:
        return c["text"] or ""
    return ((c.get("delta") or c.get("message") or {}).get("content")) or ""


def _absorb(result: RequestResult, chunk: dict) -> str:
    """Usage, finish reason and error of a chunk or response into ``result``; its text."""
    if chunk.get("error"):
        result.error = json.dumps(chunk["error"])
    usage = chunk.get("usage") or {}
    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
    if "completion_tokens" in usage:
        result.output_tokens = usage["completion_tokens"]
    choices = chunk.get("choices") or [{}]
    result.finish_reason = choices[0].get("finish_reason") or result.finish_reason
    return chunk_text(chunk)


async def send(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    disconnect_after: int | None = None,
) -> RequestResult:
    """POSTs ``body`` to ``url``; streams when ``body["stream"]``. ``disconnect_after``: close
    the connection after that many chunks with text (a client that goes away)."""
    result, start = RequestResult(), time.perf_counter()
    try:
        if not body.get("stream"):
            response = await client.post(url, json=body)
            result.status, payload = response.status_code, _json(response.text)
            result.text = _absorb(result, payload)
            result.ttft_s = time.perf_counter() - start if result.status == 200 else None
        else:
            await _stream(client, url, body, disconnect_after, result, start)
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    result.latency_s = time.perf_counter() - start
    return result


async def _stream(client, url, body, disconnect_after, result: RequestResult, start: float):
    async with client.stream("POST", url, json=body) as response:
        result.status = response.status_code
        if response.status_code != 200:
            result.error = (await response.aread()).decode(errors="replace")
            return
        decoder, last, chunks = SSEDecoder(), None, 0
        async for line in response.aiter_lines():
            data = decoder.line(line)
            if data is None or data == "[DONE]":
                continue
            text = _absorb(result, _json(data))
            if not text:
                continue
            now = time.perf_counter()
            if last is None:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            last, chunks, result.text = now, chunks + 1, result.text + text
            if disconnect_after is not None and chunks >= disconnect_after:
                result.disconnected = True
                break  # leaving the block closes the connection
        result.output_tokens = result.output_tokens or chunks


def _json(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {"error": f"not JSON: {text[:200]!r}"}
    return value if isinstance(value, dict) else {"error": f"not an object: {text[:200]!r}"}
