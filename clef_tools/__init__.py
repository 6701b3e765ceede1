"""Operators' tools around clef-serve: `clef-batch` (JSONL jobs through the worker, no HTTP)
and `clef-bench` (load against a running server, with a report and a plot)."""
