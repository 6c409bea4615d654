"""Asks meshpilot for an istioctl debug type over ADS with grpcio, as istioctl does, without
generated stubs: the request is encoded by hand, the first response printed for the test to decode.

  ads_debug.py TARGET TYPE_URL NODE_ID NAMESPACE RESOURCE_NAME|- [ROOT_PEM_FILE TOKEN]

Prints JSON: {"response": "<base64 DiscoveryResponse>"} or {"code": "...", "details": "..."}.
"""
import base64
import json
import sys

import grpc

from wire import field

METHOD = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"


def struct(values):
    entries = b""
    for key, value in values.items():
        entries += field(1, field(1, key.encode()) + field(2, field(3, value.encode())))
    return entries


def request(type_url, node_id, namespace, name):
    metadata = {"GENERATOR": "event", "NAMESPACE": namespace, "SERVICE_ACCOUNT": "default"}
    node = field(1, node_id.encode()) + field(3, struct(metadata))
    msg = field(2, node)
    if name != "-":
        msg += field(3, name.encode())
    return msg + field(4, type_url.encode())


def main():
    target, type_url, node_id, namespace, name = sys.argv[1:6]
    if len(sys.argv) > 6:
        with open(sys.argv[6], "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        options = [("grpc.ssl_target_name_override", "istiod.istio-system.svc")]
        channel = grpc.secure_channel(target, creds, options=options)
        metadata = [("authorization", f"Bearer {sys.argv[7]}")]
    else:
        channel = grpc.insecure_channel(target)
        metadata = []
    with channel:
        call = channel.stream_stream(METHOD)
        try:
            responses = call(iter([request(type_url, node_id, namespace, name)]), metadata=metadata, timeout=30)
            first = next(responses)
            print(json.dumps({"response": base64.b64encode(first).decode()}))
        except grpc.RpcError as e:
            print(json.dumps({"code": e.code().name, "details": e.details()}))


if __name__ == "__main__":
    main()
