"""The audit service: a FastAPI application over a kvledger store (`kvledger.api.app.create_app`)."""
