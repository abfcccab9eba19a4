"""Test-session setup: provide the two extra megatron-core stacks some distributed tests check against.

* ``.cache/mcore019``: megatron-core 0.19.2, the only wheel that ships ``megatron.training`` (Megatron-LM's
  own argument parsing and validation), installed without dependencies beside our 0.16.1;
* ``.cache/mcore012``: megatron-core 0.12.2, the core MindSpeed-LLM uses (no layout flag).

They are fetched once, with pip, into the ignored ``.cache/`` folder. Without network the tests that need
them skip and say how to provide them. ``POSEIDON_TEST_NO_FETCH=1`` turns fetching off.
"""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STACKS = {
    "mcore019": ["--ignore-requires-python", "megatron-core==0.19.2"],
    "mcore012": ["megatron-core==0.12.2"],
}


def pytest_configure(config):
    if os.environ.get("POSEIDON_TEST_NO_FETCH", "") not in ("", "0"):
        return
    for folder, spec in STACKS.items():
        target = os.path.join(REPO, ".cache", folder)
        if os.path.isdir(os.path.join(target, "megatron")):
            continue
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
               "--target", target, *spec]
        print(f"[poseidon tests] providing {spec[-1]} in .cache/{folder}", file=sys.stderr)
        try:
            subprocess.run(cmd, check=True, timeout=300, capture_output=True)
        except (subprocess.SubprocessError, OSError) as exc:
            print(f"[poseidon tests] could not install {spec[-1]} ({exc}); the tests that need it skip",
                  file=sys.stderr)
