"""Calls Istio's CA API (istio.v1.auth.IstioCertificateService/CreateCertificate) with grpcio, as an
Istio agent does, without generated stubs: the two messages are encoded by hand.

  ca_client.py TARGET ROOT_PEM_FILE CSR_FILE TOKEN CLUSTER_ID [TTL_SECONDS [IMPERSONATED_IDENTITY]]

With an identity, the request's metadata asks for it as a node proxy (ztunnel) does.

Prints JSON: {"chain": [...]} or {"code": "...", "details": "..."}.
"""
import json
import sys

import grpc

from wire import field, read_varint, varint

METHOD = "/istio.v1.auth.IstioCertificateService/CreateCertificate"


def encode_request(csr, ttl, impersonate):
    body = csr.encode()
    msg = field(1, body)
    if ttl:
        msg += bytes([(3 << 3) | 0]) + varint(ttl)
    if impersonate:
        # google.protobuf.Struct {fields: {"ImpersonatedIdentity": Value{string_value}}}
        value = field(3, impersonate.encode())
        entry = field(1, b"ImpersonatedIdentity") + field(2, value)
        msg += field(4, field(1, entry))
    return msg


def decode_chain(data):
    chain, i = [], 0
    while i < len(data):
        key, i = read_varint(data, i)
        number, wire = key >> 3, key & 7
        if wire != 2:
            raise ValueError(f"unexpected wire type {wire}")
        length, i = read_varint(data, i)
        value, i = data[i : i + length], i + length
        if number == 1:
            chain.append(value.decode())
    return chain


def main():
    target, root_file, csr_file, token, cluster = sys.argv[1:6]
    ttl = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    impersonate = sys.argv[7] if len(sys.argv) > 7 else ""
    with open(root_file, "rb") as f:
        creds = grpc.ssl_channel_credentials(root_certificates=f.read())
    with open(csr_file) as f:
        csr = f.read()
    options = [("grpc.ssl_target_name_override", "istiod.istio-system.svc")]
    with grpc.secure_channel(target, creds, options=options) as channel:
        call = channel.unary_unary(METHOD)
        metadata = [("authorization", f"Bearer {token}"), ("clusterid", cluster)]
        try:
            reply = call(encode_request(csr, ttl, impersonate), metadata=metadata, timeout=10)
            print(json.dumps({"chain": decode_chain(reply)}))
        except grpc.RpcError as e:
            print(json.dumps({"code": e.code().name, "details": e.details()}))


if __name__ == "__main__":
    main()
