"""Speed and memory of the project's own parts: the allocator simulator, the estimator, the
probe against checkpoint size, the webhook under load and its resident memory."""
