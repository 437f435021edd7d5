"""kvpolicy inside existing inference engines, without forking them.

``kvpolicy.integrations.transformers``: Hugging Face transformers' continuous batching
(needs ``pip install 'kvpolicy[transformers]'``: transformers 5.17.x and PyTorch).
``kvpolicy.integrations.triggers``: the C++ triggers (when to compress) for engine loops
written in Python.
"""
