"""Replica clients: how the gateway talks to workers (and, later, to plain vLLM servers)."""
