"""Calls Istio's CA API (istio.v1.auth.IstioCertificateService/CreateCertificate) with grpcio, as an
Istio agent does, without generated stubs: the two messages are encoded by hand.

  ca_client.py TARGET ROOT_PEM_FILE CSR_FILE TOKEN CLUSTER_ID [TTL_SECONDS]

Prints JSON: {"chain": [...]} or {"code": "...", "details": "..."}.
"""
import json
import sys

import grpc

METHOD = "/istio.v1.auth.IstioCertificateService/CreateCertificate"


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_request(csr, ttl):
    body = csr.encode()
    msg = bytes([(1 << 3) | 2]) + varint(len(body)) + body
    if ttl:
        msg += bytes([(3 << 3) | 0]) + varint(ttl)
    return msg


def decode_chain(data):
    chain, i = [], 0
    while i < len(data):
        key, i = read_varint(data, i)
        field, wire = key >> 3, key & 7
        if wire != 2:
            raise ValueError(f"unexpected wire type {wire}")
        length, i = read_varint(data, i)
        value, i = data[i : i + length], i + length
        if field == 1:
            chain.append(value.decode())
    return chain


def read_varint(data, i):
    shift = result = 0
    while True:
        b = data[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


def main():
    target, root_file, csr_file, token, cluster = sys.argv[1:6]
    ttl = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    with open(root_file, "rb") as f:
        creds = grpc.ssl_channel_credentials(root_certificates=f.read())
    with open(csr_file) as f:
        csr = f.read()
    options = [("grpc.ssl_target_name_override", "istiod.istio-system.svc")]
    with grpc.secure_channel(target, creds, options=options) as channel:
        call = channel.unary_unary(METHOD)
        metadata = [("authorization", f"Bearer {token}"), ("clusterid", cluster)]
        try:
            reply = call(encode_request(csr, ttl), metadata=metadata, timeout=10)
            print(json.dumps({"chain": decode_chain(reply)}))
        except grpc.RpcError as e:
            print(json.dumps({"code": e.code().name, "details": e.details()}))


if __name__ == "__main__":
    main()
