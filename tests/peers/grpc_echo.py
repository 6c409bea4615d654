"""A gRPC echo peer for the proxyless-gRPC tests, using grpcio only (no generated stubs).

  grpc_echo.py serve [ADDR [NAME]]  listens on ADDR (127.0.0.1:0), prints "PORT <n>", then answers
                                   every call to /echo.Echo/Say and /echo.Echo/Other with NAME
                                   (echo), ':' and the request
  grpc_echo.py call TARGET MSG [METHOD [AUTHORITY]]
                                   calls METHOD (/echo.Echo/Say) at TARGET (e.g.
                                   xds:///echo.ns.svc.cluster.local:7070) and prints the reply

The client reads its xDS bootstrap from GRPC_XDS_BOOTSTRAP, as any proxyless gRPC client does.
"""
import sys
from concurrent import futures

import grpc

METHOD = "/echo.Echo/Say"


def serve(address, name):
    def say(request, context):
        return name.encode() + b":" + request

    handler = grpc.method_handlers_generic_handler(
        "echo.Echo",
        {method: grpc.unary_unary_rpc_method_handler(say) for method in ("Say", "Other")},
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(address)
    server.start()
    print(f"PORT {port}", flush=True)
    server.wait_for_termination()


def call(target, message, method=METHOD, authority=None):
    options = [("grpc.default_authority", authority)] if authority else []
    with grpc.insecure_channel(target, options=options) as channel:
        say = channel.unary_unary(method)
        reply = say(message.encode(), timeout=10, wait_for_ready=True)
        print(reply.decode(), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        args = sys.argv[2:] + ["127.0.0.1:0", "echo"][len(sys.argv[2:]):]
        serve(args[0], args[1])
    else:
        call(*sys.argv[2:])
