"""Replica clients: phasegate workers and OpenAI-compatible servers, and the pool that picks one."""
