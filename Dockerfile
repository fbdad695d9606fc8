# The kvledger audit service. Build: docker build -t kvledger .
# Run (see docker-compose.yml): kvledger db upgrade --db URL && kvledger serve --host 0.0.0.0 --db URL
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# Only what the package needs: the service never imports the connector's heavy extras (torch).
COPY pyproject.toml setup.py README* alembic.ini ./
COPY kvledger kvledger
COPY ledger ledger
COPY migrations migrations
COPY api api
COPY connector connector
COPY cli cli
COPY proxy proxy
RUN pip install '.[postgres,nats]' pydantic-settings jinja2 \
    && useradd --create-home --uid 10001 kvledger

USER kvledger
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=2)"
CMD ["kvledger", "serve", "--host", "0.0.0.0", "--port", "8000"]
