"""Framework layer: launcher, per-rank bootstrap, CPU shim, profiling hooks, plan broadcast and apply.

The only part of Poseidon that imports torch / Megatron; submodules are imported explicitly
(e.g. ``from poseidon_plugin.emulation import cpu_shim``), nothing is imported eagerly here.
"""
