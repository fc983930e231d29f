"""The HTTP API (FastAPI): the app factory and its routes. See docs/api.md."""
