"""`vlmod demo`'s server process: bind the port, load the model (`vlmod.demo.app.create_app`),
serve with uvicorn until stopped, and clean up what it made (its uploads' temp folder)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from vlmod.demo import guards
from vlmod.demo.app import DemoSetupError, create_app
from vlmod.demo.guards import stoppable_server


def serve(
    model_dir: str | Path | None = None,
    dense_dir: str | Path | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    **kwargs: Any,
) -> None:
    """Load the model and serve the demo with uvicorn until interrupted. The port is bound before
    the model loads, so a busy port fails at once and the address printed is one that listens.
    Uploads go to a private temp folder (without `tmp_dir`), removed when the server stops; a
    SIGINT or SIGTERM stops the requests in progress too (`stoppable_server`)."""
    import socket

    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise DemoSetupError(
            f"cannot listen on {host}:{port} ({err.strerror or err}); pick another --port or --host"
        ) from None
    own_tmp = kwargs.get("tmp_dir") is None
    if own_tmp:
        kwargs["tmp_dir"] = tempfile.mkdtemp(prefix="vlmod-demo-")
    try:
        app = create_app(model_dir, dense_dir, **kwargs)
        sock.listen(128)
        if host in ("0.0.0.0", "::"):
            where = f"all interfaces, port {port} (http://{socket.gethostname()}:{port}, http://localhost:{port})"
        else:
            where = f"http://{'localhost' if host == '127.0.0.1' else host}:{port}"
        print(f"vlmod demo: serving {app.state.loaded.path} on {where}", flush=True)
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=guards.STOP_GRACE_S)
        server = stoppable_server(config, app.state.stopping)
        server.run(sockets=[sock])
    finally:
        sock.close()
        if own_tmp:
            shutil.rmtree(kwargs["tmp_dir"], ignore_errors=True)
    server.raise_caught()  # a SIGINT ends as Ctrl-C does, a SIGTERM as a kill: now that all is cleaned up


__all__ = ["serve"]
