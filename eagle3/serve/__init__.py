"""OpenAI-compatible server: app (routes, SSE), protocol (request models, errors), queue (bounded
queue + the engine thread driving a scheduler), metrics (Prometheus), highlight (draft-token
spans), cli (`eagle3 serve`).

Import cost: fastapi/uvicorn are imported only when the server is built.
"""
from .cli import build_parser, serve_main


def create_app(*args, **kwargs):
    """See eagle3.serve.app.create_app."""
    from .app import create_app as _create_app
    return _create_app(*args, **kwargs)


__all__ = ["create_app", "serve_main", "build_parser"]
