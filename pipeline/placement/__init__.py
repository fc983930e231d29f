"""Node placement: FSDP2 sharding with explicit prefetch, parked models returned just in time, NUMA
binding, and the NodeEngine that runs one request across a node's devices (see docs/node.md).

Import from the submodules (``pipeline.placement.engine`` ...). This package itself imports
nothing, so the torch-free parts (``relay``, ``render_job``: what the worker's Celery parent needs
to talk to the ranks) stay torch-free.
"""
