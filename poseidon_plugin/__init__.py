"""Poseidon: heterogeneity-aware parallelism planning and launching for Megatron-LM / MindSpeed-LLM.

The planning core (``specs``, ``costmodel``, ``simulator``, ``search``, ``plan``) imports neither
torch nor Megatron; only ``poseidon_plugin.runtime`` does.
"""

__version__ = "0.1.0"
