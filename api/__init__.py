"""The audit service: a FastAPI application over a kvledger store (`api.app.create_app`)."""
