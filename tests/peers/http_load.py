"""A client application for traffic tests: sends COUNT GETs for PATH to ADDRESS (host:port) with
the Host header HOST over one keep-alive connection (reopened if the server closes it) and prints a
JSON line per response: status, the backend that answered, the path and request headers it saw (from
the echo peer's body) and the response's headers.

  http_load.py ADDRESS HOST PATH COUNT [HEADER:VALUE ...]
"""
import http.client
import json
import sys


def main():
    address, host, path, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    headers = {"Host": host}
    for item in sys.argv[5:]:
        name, value = item.split(":", 1)
        headers[name] = value
    ip, port = address.rsplit(":", 1)
    conn = None
    for _ in range(count):
        try:
            if conn is None:
                conn = http.client.HTTPConnection(ip, int(port), timeout=10)
            conn.request("GET", path, headers=headers)
            response = conn.getresponse()
            body = response.read()
            status = response.status
            received = {k.lower(): v for k, v in response.getheaders()}
            if response.getheader("connection", "").lower() == "close":
                conn.close()
                conn = None
        except (OSError, http.client.HTTPException) as error:
            status, body, received = 0, str(error).encode(), {}
            if conn is not None:
                conn.close()
            conn = None
        try:
            echoed = json.loads(body)
        except ValueError:
            echoed = {}
        print(json.dumps({"status": status, "server": echoed.get("server"), "path": echoed.get("path"),
                          "seen": echoed.get("headers", {}), "headers": received}), flush=True)


if __name__ == "__main__":
    main()
