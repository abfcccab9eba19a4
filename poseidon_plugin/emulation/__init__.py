"""The CPU emulation harness: heterogeneous devices emulated on CPU ranks (``--poseidon-emulate``,
``--poseidon-emulate-model``) and the CPU shim that runs megatron-core on gloo, with their patch tables.

The bootstrap reaches this package through the device interface (``runtime/devices.py``) only; see
docs/ARCHITECTURE.md. Nothing is imported eagerly here.
"""
