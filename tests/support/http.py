"""In-test HTTP servers (stand-ins for a replica, its /metrics, a webhook receiver): one way to serve a
handler on a free port of 127.0.0.1 from a thread, and the handler base of those that speak HTTP/1.1."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class QuietHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 (kept-alive connections, as vLLM's server and the gateway's client use them), no request log."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass


class ServerThread:
    """An in-test HTTP server: `handler` (a BaseHTTPRequestHandler class) on a free port of 127.0.0.1, served
    from a daemon thread until stop()."""

    def serve(self, handler) -> "ServerThread":
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self):
        self.server.shutdown()
        self.server.server_close()
