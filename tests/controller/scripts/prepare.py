"""A data-preparation step that runs before training (no optimizer): it must run normally."""

import sys

marker = sys.argv[1]
with open(marker, "w") as handle:
    handle.write("prepared\n")
print("prepared", marker, flush=True)
