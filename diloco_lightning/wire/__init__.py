"""The wire format: what is on a hub, byte for byte, and how an untrusted copy of it is read.

``names`` (node ids, hub paths) and ``layout`` (a safetensors file's layout, checked before its data)
-> ``signing`` -> ``statefile`` (a state as one safetensors file, no pickle), ``manifest`` (the
published version, the lease), ``claims`` (a node's claim on its id), ``delta/`` (the delta file),
``fragments`` (which keys sync together). Depends on ``util`` and ``encoding`` only.
"""
