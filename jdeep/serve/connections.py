"""Deadlines on what a client sends, so a slow or silent client cannot hold a connection (slowloris).

Two phases, each given `read_timeout` seconds:
- The request line and headers: uvicorn waits for them without a limit (its keep-alive timeout starts only after
  a response). `h11_with_header_timeout` is its h11 protocol with a timer armed when a connection opens and after
  each response; a connection that has not completed a new request's headers when it fires is closed.
- The body: `ReadDeadline` wraps an HTTP request's ASGI `receive`; while the body is still arriving, each read
  waits at most until `read_timeout` seconds after the request began, then raises RequestBodyTimeout (the server
  answers 408 with `Connection: close`). Once the body is complete, reads pass through unchanged (they wait for
  the client's disconnect for as long as the answer takes).
"""

from __future__ import annotations

import asyncio
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["RequestBodyTimeout", "ReadDeadline", "h11_with_header_timeout"]


class RequestBodyTimeout(Exception):
    """The request's body did not arrive within the read timeout."""


class ReadDeadline:
    """An ASGI receive for one HTTP request whose body must be complete within `timeout` seconds of its start."""

    def __init__(self, receive, timeout: float):
        self.receive, self.timeout = receive, timeout
        self.deadline = time.monotonic() + timeout
        self.body_done = False

    async def __call__(self) -> dict:
        if self.body_done:
            return await self.receive()
        left = self.deadline - time.monotonic()
        try:
            message = await asyncio.wait_for(self.receive(), max(left, 0.0))
        except asyncio.TimeoutError:
            raise RequestBodyTimeout(f"the request body did not arrive within {self.timeout:g} s") from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.body_done = True
        return message


def h11_with_header_timeout(timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol that closes a connection which has not sent a complete request line and headers
    within `timeout` seconds of opening, or of the end of its previous response."""

    class H11WithHeaderTimeout(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout, self._headers_due, self.cycle)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_due(self, cycle) -> None:
            self._header_timer = None
            waiting = cycle is None or cycle.response_complete      # (not a request being answered)
            if self.cycle is cycle and waiting and not self.transport.is_closing():    # no new request since
                self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return H11WithHeaderTimeout
