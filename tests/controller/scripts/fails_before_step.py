"""A user's training script that dies while loading its data, before any optimizer step."""

import sys

print("loading shards from /data/train-*.arrow", flush=True)
print("found 0 shards", flush=True)
print("giving up: the dataset is empty", file=sys.stderr, flush=True)
raise FileNotFoundError("no training shards under /data")
