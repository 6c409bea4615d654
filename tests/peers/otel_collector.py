"""An OpenTelemetry trace collector for traffic tests: serves OTLP's gRPC TraceService (the
collector's own protos, PyPI's opentelemetry-proto) and appends each span it receives to FILE as a
JSON line: name, kind, the resource's service.name and the span's string attributes.

  otel_collector.py PORT FILE
"""
import json
import sys
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

LOCK = threading.Lock()


def strings(attributes):
    return {a.key: a.value.string_value for a in attributes if a.value.HasField("string_value")}


class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, path):
        self.path = path

    def Export(self, request, context):
        lines = []
        for resource_spans in request.resource_spans:
            service = strings(resource_spans.resource.attributes).get("service.name")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    lines.append(json.dumps({
                        "name": span.name,
                        "kind": span.kind,
                        "service": service,
                        "attributes": strings(span.attributes),
                    }))
        with LOCK, open(self.path, "a") as out:
            out.writelines(line + "\n" for line in lines)
        return trace_service_pb2.ExportTraceServiceResponse()


if __name__ == "__main__":
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(sys.argv[2]), server)
    server.add_insecure_port(f"0.0.0.0:{sys.argv[1]}")
    server.start()
    server.wait_for_termination()
