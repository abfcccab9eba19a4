"""STAND-IN for Ascend/MindSpeed-LLM (tests only; see tests/standins/README.md). Not the real package."""
