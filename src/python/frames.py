# Frames shared by verl-rs's Python workers (prepended to each worker's script): a 4-byte
# little-endian length, then UTF-8 JSON, on the worker's stdin / stdout. Whatever user code
# prints goes to stderr, so it cannot break the frames.
import json
import os
import struct
import sys

frames_out = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)
sys.stdout = sys.stderr
frames_in = sys.stdin.buffer


def send(message):
    data = json.dumps(message).encode()
    frames_out.write(struct.pack("<I", len(data)) + data)
    frames_out.flush()


def receive():
    head = frames_in.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack("<I", head)
    return json.loads(frames_in.read(n))

