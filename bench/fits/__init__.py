"""Calibration fits: each fits a figure the contract ships (runtime overhead, what lies outside
the allocator, cuDNN's convolution workspaces) on yardstick rows, and scores it on rows it was not
fitted on."""
