"""A user's training script that loads far more into host memory than the estimation pod has."""

cache = bytearray(3 << 30)  # 3 GiB of "preloaded dataset", touched page by page below
for offset in range(0, len(cache), 4096):
    cache[offset] = 1
print("loaded", len(cache), flush=True)
