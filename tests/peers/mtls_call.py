"""An HTTP/1.1 GET over TLS as an Istio sidecar originates it: the workload certificate, the mesh
root, and the ALPN Istio's clients offer (`istio-http/1.1`, `istio`, ...). The peer's identity is
checked against the root only (its SAN is a SPIFFE URI, not a host name).

  mtls_call.py HOST PORT CERT KEY ROOT ALPN PATH

Prints the response body; exits 1 with the error when the exchange fails.
"""
import socket
import ssl
import sys


def main():
    host, port, cert, key, root, alpn, path = sys.argv[1:8]
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.load_verify_locations(root)
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols([alpn])
    try:
        with socket.create_connection((host, int(port)), timeout=3) as raw:
            with context.wrap_socket(raw) as tls:
                request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
                tls.sendall(request.encode())
                answer = b""
                while chunk := tls.recv(65536):
                    answer += chunk
    except (OSError, ssl.SSLError) as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
    _, _, body = answer.partition(b"\r\n\r\n")
    print(body.decode(errors="replace"))


if __name__ == "__main__":
    main()
