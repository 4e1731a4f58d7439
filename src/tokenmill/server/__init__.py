"""An OpenAI-compatible HTTP server over ``LLMEngine``: FastAPI routes, the engine in its own process (or a
thread), metrics."""

from tokenmill.server.app import ServerThread, create_app, default_served_model_name, serve
from tokenmill.server.engine_client import EngineClient, EngineStartupError
from tokenmill.server.generation import ServerSettings

__all__ = [
    "EngineClient",
    "EngineStartupError",
    "ServerSettings",
    "ServerThread",
    "create_app",
    "default_served_model_name",
    "serve",
]
