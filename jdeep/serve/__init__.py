"""The OpenAI-compatible HTTP server on the continuous-batching engine: server.py (starlette app, routes,
uvicorn), openai_protocol.py (request parsing, response bodies), async_engine.py (the engine on its own thread,
asyncio streams), metrics.py (Prometheus text)."""
