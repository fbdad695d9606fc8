"""The service's routers, one file per resource: health, transfers, audit, replay, events, web."""
