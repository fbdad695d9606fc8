"""The two parts of observe mode's stats payload (vLLM-free, read by both adapters and `connector/prom.py`)."""

WRAPPED = "wrapped"
"""The wrapped connector's own stats, unchanged."""
KVLEDGER = "kvledger"
"""The ledger's figures (`connector/figures.py`)."""
WRAPPED_CONNECTOR = "wrapped_connector"
"""The wrapped connector's registered name: how a payload's wrapped part is rebuilt into its stats class."""
