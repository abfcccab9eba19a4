"""Compiled twins of Poseidon's hot paths (built by setup.py; pure-Python references live in poseidon_plugin)."""
