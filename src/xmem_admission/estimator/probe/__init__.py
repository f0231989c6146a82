"""Running a training script under a virtual GPU and recording its allocations (needs torch).

``sitehook`` is how the probe enters the user's interpreter (a ``sitecustomize`` in the bundle),
``runner`` drives one traced run, ``virtual_cuda`` and ``torch_patches`` make the CPU answer as
the target GPU, ``tracker`` records every storage's allocation and free with its category and
phase, ``autocast`` and ``attention`` apply CUDA's op lists and attention-kernel choice.
"""
