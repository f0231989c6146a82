"""Accuracy yardsticks: the estimator against jobs measured on real GPUs (the xMem paper's rows,
GPUMemNet's A100 rows, the project's own H200 run) and the OOM retry loop replayed on them."""
