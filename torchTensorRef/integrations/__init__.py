"""torch and other libraries made to hand TensorRefs to the manager: patching of torch's
creation functions, ``manage()``, checkpoints (``torch.load``, safetensors, Hugging Face),
``torch.distributed``, ``torch.compile`` and compiled regions.

May import every layer below (core, strategies, analysis, memory, ops); nothing below
imports it. :mod:`.patching` is the top of this layer: the other modules here never import it.
"""
