"""The OpenAI-compatible HTTP server on the continuous-batching engine: server.py (starlette app, routes,
uvicorn), openai_protocol.py (request parsing, response bodies), async_engine.py (the engine on its own thread,
asyncio streams, back-pressure and timeouts), metrics.py (Prometheus text), server_metrics.py (the server's metric
set). Limits and failure handling: docs/serving.md."""
