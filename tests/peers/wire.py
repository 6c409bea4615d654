"""Protobuf wire encoding by hand for the grpcio peers (no generated stubs)."""


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


def field(number, body):
    """A length-delimited field."""
    return bytes([(number << 3) | 2]) + varint(len(body)) + body


def read_varint(data, i):
    shift = result = 0
    while True:
        b = data[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7
