"""A simulation of PyTorch's CUDA caching allocator (standard library only).

``caching`` holds the allocator (pools, rounding, best fit, splitting and merging), on
``blocks`` (its data: blocks, pools, expandable segments), with ``segments`` (device addresses,
the segment table and the checks), ``expandable`` (expandable segments), ``cache_release``
(giving cached segments back before an OOM), ``statistics`` (``torch.cuda.memory_stats``
counters) and ``alloc_conf`` (``PYTORCH_CUDA_ALLOC_CONF``). ``simulate`` replays a trace;
``snapshot`` replays a real ``torch.cuda.memory._dump_snapshot()`` to check the simulator.
"""
