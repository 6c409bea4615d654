"""An MCP registry for tests, as Nacos or another service registry feeds istiod: serves COUNT
ServiceEntries (`registry/svc-<i>`, host `svc-<i>.registry.example`, one static endpoint each)
over ADS on PORT at API VERSION (default v1; Nacos and istiod before 1.22 know only v1alpha3);
every other type, other versions of ServiceEntry included, is answered empty, as istiod 1.14
answers them. The messages are generated here, when it starts, from the project's own Istio
protos (proto/istio) and the ADS subset beside this file. Each time FILE changes (a number), the
set grows or shrinks to that many and is pushed again.

  mcp_registry.py PORT COUNT [FILE [VERSION]]
"""
import os
import sys
import tempfile
import threading
import time
from concurrent import futures

import grpc
from grpc_tools import protoc

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = os.path.join(HERE, "..", "..", "proto")
SERVICE_ENTRY = "networking.istio.io/{}/ServiceEntry".format(sys.argv[4] if len(sys.argv) > 4 else "v1")


def generate():
    """Generates the Python messages and stubs; returns the output directory."""
    out = tempfile.mkdtemp(prefix="mcp-registry-")
    istio = [
        os.path.relpath(os.path.join(root, name), PROTO)
        for root, _, names in os.walk(os.path.join(PROTO, "istio"))
        for name in names
        if name.endswith(".proto")
    ]
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    args = ["protoc", f"-I{PROTO}", f"-I{os.path.join(HERE, 'mcp')}", f"-I{include}",
            f"--python_out={out}", f"--grpc_python_out={out}", "discovery.proto", *istio]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")
    return out


sys.path.insert(0, generate())
import discovery_pb2  # noqa: E402
import discovery_pb2_grpc  # noqa: E402
from istio.mcp.v1alpha1 import resource_pb2  # noqa: E402
from istio.networking.v1alpha3 import service_entry_pb2  # noqa: E402


def entries(count):
    out = []
    for i in range(count):
        spec = service_entry_pb2.ServiceEntry(
            hosts=[f"svc-{i}.registry.example"],
            location=service_entry_pb2.ServiceEntry.MESH_INTERNAL,
            resolution=service_entry_pb2.ServiceEntry.STATIC,
        )
        spec.ports.add(number=8080, name="http", protocol="HTTP")
        spec.endpoints.add(address=f"10.{100 + i // 65536}.{(i // 256) % 256}.{i % 256}")
        resource = resource_pb2.Resource()
        resource.metadata.name = f"registry/svc-{i}"
        resource.metadata.version = "1"
        resource.body.Pack(spec)
        any_resource = discovery_pb2.DiscoveryResponse().resources.add()
        any_resource.Pack(resource)
        out.append(any_resource)
    return out


class Registry(discovery_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, count):
        self.lock = threading.Condition()
        self.generation = 1
        self.set(count)

    def set(self, count):
        with self.lock:
            self.resources = entries(count)
            self.generation += 1
            self.lock.notify_all()

    def StreamAggregatedResources(self, requests, context):
        watched = {}
        sent = {}
        queue = []
        cond = threading.Condition()

        def read():
            try:
                for request in requests:
                    with cond:
                        if request.response_nonce and request.response_nonce == sent.get(request.type_url):
                            continue  # an ACK (or NACK) of ours
                        watched[request.type_url] = True
                        queue.append(request.type_url)
                        cond.notify_all()
            except grpc.RpcError:
                pass  # the client went away
            with cond:
                queue.append(None)
                cond.notify_all()

        threading.Thread(target=read, daemon=True).start()
        seen_generation = self.generation
        while context.is_active():
            with cond:
                cond.wait_for(lambda: queue, timeout=0.2)
                types = list(queue)
                queue.clear()
            if None in types:
                return
            with self.lock:
                if self.generation != seen_generation:
                    seen_generation = self.generation
                    types.extend(t for t in watched if t == SERVICE_ENTRY)
                resources = list(self.resources)
            for type_url in dict.fromkeys(types):
                nonce = f"{type_url}-{time.monotonic_ns()}"
                sent[type_url] = nonce
                yield discovery_pb2.DiscoveryResponse(
                    version_info=str(seen_generation),
                    type_url=type_url,
                    nonce=nonce,
                    resources=resources if type_url == SERVICE_ENTRY else [],
                )


def main():
    port, count = int(sys.argv[1]), int(sys.argv[2])
    control = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] else None
    registry = Registry(count)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         options=[("grpc.max_send_message_length", 512 << 20)])
    discovery_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(registry, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("serving", flush=True)
    last = None
    while True:
        time.sleep(0.1)
        if control and os.path.exists(control):
            text = open(control).read().strip()
            if text and text != last:
                last = text
                registry.set(int(text))


if __name__ == "__main__":
    main()
