"""The OpenAI-compatible 1P1D proxy (app.py): splits each completion into a prefill and a decode."""
