"""Framework layer: launcher, per-rank bootstrap, device interface, profiling hooks, plan broadcast and apply.

With ``patches/`` and ``emulation/`` the only part of Poseidon that imports torch / Megatron (its
before-launch modules do not: docs/ARCHITECTURE.md); submodules are imported explicitly
(e.g. ``from poseidon_plugin.runtime import devices``), nothing is imported eagerly here.
"""
