"""STAND-IN for Ascend/MindSpeed (tests only; see tests/standins/README.md). Not the real package."""
