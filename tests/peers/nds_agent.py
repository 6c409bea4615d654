"""The DNS half of Istio's agent, for tests: asks meshpilot for the name table over ADS with grpcio
(SotW or Delta, node metadata DNS_CAPTURE=true, as istio-agent does), ACKs every response, prints
each table it receives as one JSON line, and optionally answers DNS (A and AAAA over UDP) from the
latest table, with the agent's search-path forms of Kubernetes names.

  nds_agent.py TARGET NODE_ID NAMESPACE CLUSTER_ID NETWORK [--delta] [--dns HOST:PORT]

Prints {"table": {host: {"ips": [...], "registry": ..., "shortname": ..., "namespace": ...}}} per
response, {"listening": "HOST:PORT"} once DNS is served, and {"code": ..., "details": ...} if the
stream fails.
"""
import ipaddress
import json
import queue
import socket
import struct
import sys
import threading

import grpc

from wire import field, read_varint

NDS = "type.googleapis.com/istio.networking.nds.v1.NameTable"
SOTW = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
DELTA = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"


def fields(data):
    """(number, value) pairs of a message: varints as ints, length-delimited fields as bytes."""
    i = 0
    while i < len(data):
        key, i = read_varint(data, i)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, i = read_varint(data, i)
        elif wire_type == 2:
            size, i = read_varint(data, i)
            value, i = data[i:i + size], i + size
        elif wire_type == 1:
            value, i = data[i:i + 8], i + 8
        elif wire_type == 5:
            value, i = data[i:i + 4], i + 4
        else:
            raise ValueError(f"wire type {wire_type}")
        yield number, value


def name_info(data):
    info = {"ips": [], "registry": "", "shortname": "", "namespace": ""}
    for number, value in fields(data):
        if number == 1:
            info["ips"].append(value.decode())
        elif number in (2, 3, 4):
            info[["registry", "shortname", "namespace"][number - 2]] = value.decode()
    return info


def name_table(any_bytes):
    type_url, value = "", b""
    for number, v in fields(any_bytes):
        if number == 1:
            type_url = v.decode()
        elif number == 2:
            value = v
    assert type_url == NDS, type_url
    table = {}
    for number, entry in fields(value):
        if number == 1:
            key, info = "", {}
            for n, v in fields(entry):
                if n == 1:
                    key = v.decode()
                elif n == 2:
                    info = name_info(v)
            table[key] = info
    return table


def pb_struct(values):
    entries = b""
    for key, value in values.items():
        entries += field(1, field(1, key.encode()) + field(2, field(3, value.encode())))
    return entries


def node(node_id, namespace, cluster, network):
    metadata = {"DNS_CAPTURE": "true", "NAMESPACE": namespace, "CLUSTER_ID": cluster,
                "ISTIO_VERSION": "1.26.0"}
    if network:
        metadata["NETWORK"] = network
    return field(1, node_id.encode()) + field(3, pb_struct(metadata))


class Agent:
    def __init__(self, target, node_id, namespace, cluster, network, delta):
        self.node = node(node_id, namespace, cluster, network)
        self.namespace = namespace
        self.delta = delta
        self.table = {}
        self.lock = threading.Lock()
        self.requests = queue.Queue()
        self.channel = grpc.insecure_channel(target)

    def first_request(self):
        if self.delta:
            return field(1, self.node) + field(2, NDS.encode())
        return field(2, self.node) + field(4, NDS.encode())

    def ack(self, version, nonce):
        if self.delta:
            return field(2, NDS.encode()) + field(6, nonce.encode())
        return field(1, version.encode()) + field(4, NDS.encode()) + field(5, nonce.encode())

    def outgoing(self):
        yield self.first_request()
        while True:
            yield self.requests.get()

    def run(self):
        call = self.channel.stream_stream(DELTA if self.delta else SOTW)
        try:
            for response in call(self.outgoing()):
                self.receive(response)
        except grpc.RpcError as e:
            print(json.dumps({"code": e.code().name, "details": e.details()}), flush=True)

    def receive(self, response):
        version, nonce, tables = "", "", []
        for number, value in fields(response):
            if number == 1:
                version = value.decode()
            elif number == 2:
                if self.delta:
                    any_bytes = dict(fields(value)).get(2, b"")
                    tables.append(name_table(any_bytes))
                else:
                    tables.append(name_table(value))
            elif number == 5:
                nonce = value.decode()
        table = {}
        for t in tables:
            table.update(t)
        with self.lock:
            self.table = table
        print(json.dumps({"version": version, "table": table}), flush=True)
        self.requests.put(self.ack(version, nonce))

    def lookup(self, name):
        """The addresses of a name, as the agent expands Kubernetes names by search path."""
        name = name.rstrip(".").lower()
        with self.lock:
            if name in self.table:
                return self.table[name]["ips"]
            for host, info in self.table.items():
                short, ns = info["shortname"], info["namespace"]
                if not short:
                    continue
                forms = {f"{short}.{ns}", f"{short}.{ns}.svc"}
                if ns == self.namespace:
                    forms.add(short)
                if name in forms:
                    return info["ips"]
        return None

    def serve_dns(self, address):
        host, port = address.rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((host, int(port)))
        print(json.dumps({"listening": "%s:%d" % sock.getsockname()}), flush=True)
        while True:
            query, peer = sock.recvfrom(512)
            try:
                sock.sendto(self.answer(query), peer)
            except (ValueError, IndexError, struct.error) as e:
                print(f"unanswerable query: {e}", file=sys.stderr)

    def answer(self, query):
        ident, _flags, qdcount = struct.unpack("!HHH", query[:6])
        if qdcount != 1:
            raise ValueError("one question")
        labels, i = [], 12
        while query[i]:
            labels.append(query[i + 1:i + 1 + query[i]].decode())
            i += 1 + query[i]
        qtype, _qclass = struct.unpack("!HH", query[i + 1:i + 5])
        question = query[12:i + 5]
        ips = self.lookup(".".join(labels))
        family = {1: 4, 28: 6}.get(qtype)
        answers = []
        for ip in ips or []:
            parsed = ipaddress.ip_address(ip)
            if parsed.version == family:
                answers.append(b"\xc0\x0c" + struct.pack("!HHIH", qtype, 1, 30, len(parsed.packed))
                               + parsed.packed)
        rcode = 3 if ips is None else 0
        header = struct.pack("!HHHHHH", ident, 0x8180 | rcode, 1, len(answers), 0, 0)
        return header + question + b"".join(answers)


def main():
    target, node_id, namespace, cluster, network = sys.argv[1:6]
    rest = sys.argv[6:]
    agent = Agent(target, node_id, namespace, cluster, network, "--delta" in rest)
    if "--dns" in rest:
        address = rest[rest.index("--dns") + 1]
        threading.Thread(target=agent.serve_dns, args=(address,), daemon=True).start()
    agent.run()


if __name__ == "__main__":
    main()
