"""The Python data path's guard on its clients' connections (uvicorn's httptools protocol, extended): what the
compiled data path does in main.rs (Limits, hyper's header-read timeout, read_request_body's deadline).

uvicorn 0.54 alone bounds none of it: its keep-alive timer starts only after a first answer and is cancelled by
every byte received (httptools_impl.py data_received -> _unset_keepalive_if_required), so an idle socket, a head
trickling in a byte at a time, or a body announced and never sent hold a connection for ever, and any number of
them may be open. Here (docs/gateway-hardening.md):
- a connection with no request in progress closes after GATEWAY_IDLE_TIMEOUT_SECONDS (at its start too);
- a request head must be complete within GATEWAY_HEADER_TIMEOUT_SECONDS of its first byte;
- a request body within GATEWAY_BODY_TIMEOUT_SECONDS of its head;
- at most GATEWAY_MAX_CONNECTIONS connections, GATEWAY_MAX_CONNECTIONS_PER_ADDRESS from one address (0: no such
  cap); one over a cap gets a 503 and is closed.
A request with both Content-Length and Transfer-Encoding is refused by httptools itself (llhttp: "Transfer-Encoding
can't be present with Content-Length"), which uvicorn answers 400 and closes: RFC 9112 §6.1, as the compiled path
does. A body is read before the key check only as far as uvicorn's flow control lets it (HIGH_WATER_LIMIT, 64 KiB),
then reading pauses until the gateway asks for the body.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from django.conf import settings
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

TOO_MANY_CONNECTIONS = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
)
REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with timeouts for the head, the body and idleness, and caps on connections."""

    open_connections = 0
    per_address: Counter = Counter()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline: asyncio.TimerHandle | None = None
        self.counted = False
        self.answering = False  # a request of this connection is with the app (its head and body are in)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        address = self.client[0] if self.client else ""
        cls = GuardedProtocol
        per_address = settings.GATEWAY_MAX_CONNECTIONS_PER_ADDRESS
        if cls.open_connections >= settings.GATEWAY_MAX_CONNECTIONS or (
            per_address and cls.per_address[address] >= per_address
        ):
            transport.write(TOO_MANY_CONNECTIONS)
            transport.close()
            return
        self.counted, self.address = True, address
        cls.open_connections += 1
        cls.per_address[address] += 1
        self._arm(settings.GATEWAY_IDLE_TIMEOUT_SECONDS)

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self.counted:
            self.counted = False
            cls = GuardedProtocol
            cls.open_connections -= 1
            cls.per_address[self.address] -= 1
            if cls.per_address[self.address] <= 0:
                del cls.per_address[self.address]
        super().connection_lost(exc)

    def _arm(self, seconds: float, answer: bytes = b"") -> None:
        self._disarm()
        self.deadline = self.loop.call_later(seconds, self._expired, answer)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expired(self, answer: bytes) -> None:
        self.deadline = None
        if not self.transport.is_closing():
            if answer and (self.cycle is None or not self.cycle.response_started):
                self.transport.write(answer)
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(settings.GATEWAY_HEADER_TIMEOUT_SECONDS, REQUEST_TIMEOUT)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm(settings.GATEWAY_BODY_TIMEOUT_SECONDS, REQUEST_TIMEOUT)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()  # with the app now; the idle timer starts again when its answer is complete

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # uvicorn's keep-alive timer is armed too, but any byte cancels it; ours only a request's first byte.
        idle = self.cycle is None or self.cycle.response_complete  # not a pipelined request with the app
        if idle and not self.transport.is_closing() and self.deadline is None:
            self._arm(settings.GATEWAY_IDLE_TIMEOUT_SECONDS)
