"""A user's training script stuck waiting for something that never comes (a dead rendezvous)."""

import time

print("waiting for the data service", flush=True)
time.sleep(600)
