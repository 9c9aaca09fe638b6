"""FastServe on Ray: an OpenAI-compatible LLM server with skip-join MLFQ scheduling and proactive
KV-cache swapping. Importing this package imports nothing else; its rooms: docs/design.md."""
