"""A gRPC echo peer for the proxyless-gRPC tests, using grpcio only (no generated stubs).

  grpc_echo.py serve            prints "PORT <n>", then echoes every call to /echo.Echo/Say
  grpc_echo.py call TARGET MSG  calls TARGET (e.g. xds:///echo.ns.svc.cluster.local:7070) and prints the reply

The client reads its xDS bootstrap from GRPC_XDS_BOOTSTRAP, as any proxyless gRPC client does.
"""
import sys
from concurrent import futures

import grpc

METHOD = "/echo.Echo/Say"


def serve():
    def say(request, context):
        return b"echo:" + request

    handler = grpc.method_handlers_generic_handler(
        "echo.Echo", {"Say": grpc.unary_unary_rpc_method_handler(say)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"PORT {port}", flush=True)
    server.wait_for_termination()


def call(target, message):
    with grpc.insecure_channel(target) as channel:
        say = channel.unary_unary(METHOD)
        reply = say(message.encode(), timeout=10, wait_for_ready=True)
        print(reply.decode(), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve()
    else:
        call(sys.argv[2], sys.argv[3])
