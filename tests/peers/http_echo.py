"""An HTTP backend for traffic tests: answers every GET with JSON of the path, the request headers
and the address it was reached at (which backend answered). Query parameters shape the answer:
`status=N` answers with that status, `delay=S` waits S seconds first. `GET /_counts` returns how
many requests each path (without its query) has seen.

  http_echo.py [ADDRESS:]PORT [CERT KEY CLIENT_CA]

Without ADDRESS it listens on every address (an application bound to its pod IP gives one).

With CERT, KEY and CLIENT_CA it serves HTTPS and requires a client certificate CLIENT_CA signed;
the answer then names the client certificate's subject (`client`).
"""
import json
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

COUNTS = {}
LOCK = threading.Lock()


class Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: without this each answer waits for a delayed ACK.
    disable_nagle_algorithm = True

    def do_GET(self):
        url = urlsplit(self.path)
        if url.path == "/_counts":
            with LOCK:
                self.reply(200, dict(COUNTS))
            return
        with LOCK:
            COUNTS[url.path] = COUNTS.get(url.path, 0) + 1
        query = parse_qs(url.query)
        if "delay" in query:
            time.sleep(float(query["delay"][0]))
        status = int(query.get("status", ["200"])[0])
        answer = {
            "path": self.path,
            "server": self.connection.getsockname()[0],
            "headers": {k.lower(): v for k, v in self.headers.items()},
        }
        if isinstance(self.connection, ssl.SSLSocket):
            peer = self.connection.getpeercert() or {}
            answer["client"] = dict(part[0] for part in peer.get("subject", ()))
            answer["client_sans"] = [value for _, value in peer.get("subjectAltName", ())]
        self.reply(status, answer)

    def reply(self, status, value):
        body = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    address, _, port = sys.argv[1].rpartition(":")
    server = ThreadingHTTPServer((address or "0.0.0.0", int(port)), Echo)
    if len(sys.argv) > 4:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(sys.argv[2], sys.argv[3])
        context.load_verify_locations(sys.argv[4])
        context.verify_mode = ssl.CERT_REQUIRED
        server.socket = context.wrap_socket(server.socket, server_side=True)
    server.serve_forever()
