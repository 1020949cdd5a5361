"""``specdraft serve``: an OpenAI-compatible HTTP server with continuous batching.

Modules: ``protocol`` (wire format, validation, errors), ``streaming`` (incremental
detokenization), ``scheduler`` (the continuous-batching thread), ``metrics``
(Prometheus), ``app`` (FastAPI routes), ``runner`` (uvicorn with a graceful drain).
Needs the ``[serve]`` extra (fastapi, uvicorn, prometheus-client).
"""

from .app import ServeOptions, create_app

__all__ = ["ServeOptions", "create_app"]
