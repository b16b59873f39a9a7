"""Shared memory across machines and teammates, on PostgreSQL + pgvector (sync worker, shared search)."""
