"""An OpenAI-compatible HTTP server over ``LLMEngine``: FastAPI routes, an engine loop thread, metrics."""

from tokenmill.server.app import ServerThread, create_app, default_served_model_name, serve
from tokenmill.server.generation import ServerSettings

__all__ = ["ServerSettings", "ServerThread", "create_app", "default_served_model_name", "serve"]
