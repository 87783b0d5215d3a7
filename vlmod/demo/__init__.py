"""The vlmod web demo: which vision tokens each MoD layer runs, on your images and videos.

`vlmod demo` (or `python demo/server.py`) serves it; `create_app` builds the ASGI app. The server
needs the `demo` extra (starlette, uvicorn, python-multipart); importing this package does not.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app", "serve"]


def __getattr__(name: str) -> Any:
    # Lazy, so `python -m vlmod.demo.examples` and the analysis code work without the server extra.
    if name in __all__:
        from vlmod.demo import app

        return getattr(app, name)
    raise AttributeError(f"module 'vlmod.demo' has no attribute {name!r}")
