"""uvicorn with a graceful shutdown that knows about the engine.

On SIGTERM or Ctrl-C, uvicorn stops accepting connections and waits for the open ones. The engine is told at
once: queued requests are answered 503, and the running answer may finish within ``grace_s`` seconds; after
that it is cancelled and ends properly (a streamed one with an error event and ``data: [DONE]``), so uvicorn's
own deadline (a little later, as a backstop) never has to kill a request mid-flight."""

from __future__ import annotations

import uvicorn

from cats.serve.engine import Engine

BACKSTOP_S = 5.0  # uvicorn's deadline after ours


class GracefulServer(uvicorn.Server):
    def __init__(self, app, engine: Engine, grace_s: float = 10.0, **config):
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=grace_s + BACKSTOP_S, **config))
        self.engine, self.grace_s = engine, grace_s

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self.engine.shutdown_threadsafe(self.grace_s)
