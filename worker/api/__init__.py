"""The HTTP API under /v1: ``worker.api.app.create_app`` builds it."""
