"""Convolution studies: what cuDNN's convolutions ask the caching allocator for, measured on a GPU
or planned by cuDNN's heuristics without one, against the fitted rule."""
