"""Cluster benchmarks: held Jobs released on the project's real control plane (localkube) or a
real kubelet, and the estimation line's cost with a large backlog."""
