"""``python -m pagedspec.serve``: parse the flags, load the model, serve until SIGTERM / Ctrl-C.

On SIGTERM (or Ctrl-C) the server drains (``pagedspec.engine.serve.graceful``): new requests and
``/health`` get 503 while the running requests go on for up to ``--shutdown-timeout`` seconds;
then what is left is aborted (streams end with finish reason "abort" and ``[DONE]``), the
engine thread stops and the process exits with status 0.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

from pagedspec.engine.serve.cli import parse_args


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # The server's imports (torch, the engine, uvicorn) only once the flags pass.
    import uvicorn

    from pagedspec.engine.core.llm_engine import LLMEngine
    from pagedspec.engine.serve.app import create_app
    from pagedspec.engine.serve.async_engine import AsyncEngine
    from pagedspec.engine.serve.graceful import DrainingServer

    # While serving, the server's own handler drains; it then restores this handler and
    # re-raises SIGTERM to it, which is how the process ends with status 0.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    engine = AsyncEngine(LLMEngine(args.engine), args.max_queue)
    app = create_app(engine, args.served_model_name, args.api_key)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    DrainingServer(config, engine, args.shutdown_timeout).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
