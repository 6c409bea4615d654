"""A Zipkin collector for traffic tests: accepts spans as Zipkin's v2 API receives them
(`POST /api/v2/spans`, a JSON list) and answers `GET /spans` with every span received so far.

  zipkin_collector.py PORT
"""
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SPANS = []
LOCK = threading.Lock()


class Collector(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.body()
        if self.path != "/api/v2/spans":
            self.answer(404, b"")
            return
        try:
            spans = json.loads(body)
        except ValueError:
            self.answer(400, b"not JSON")
            return
        with LOCK:
            SPANS.extend(spans if isinstance(spans, list) else [spans])
        self.answer(202, b"")

    def body(self):
        """The request body, whole or chunked (as Envoy sends reports)."""
        if self.headers.get("transfer-encoding", "").lower() != "chunked":
            return self.rfile.read(int(self.headers.get("content-length", "0")))
        chunks = []
        while True:
            size = int(self.rfile.readline().split(b";")[0], 16)
            chunk = self.rfile.read(size)
            self.rfile.readline()
            if size == 0:
                return b"".join(chunks)
            chunks.append(chunk)

    def do_GET(self):
        with LOCK:
            body = json.dumps(SPANS).encode()
        self.answer(200, body)

    def answer(self, status, body):
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Collector).serve_forever()
