"""The CUDA path, checked on a machine with one NVIDIA GPU (issue 13): one call, well under 8 minutes.

    python scripts/gpu_check.py [--out DIR] [--layers 4] [--iters 5]

1. ``poseidon-run --nproc-per-node 1 --poseidon-dry-run`` on CUDA: inventory, the CUDA device code (events
   for the layer, embedding and head; memory statistics), profiling of a real LLaMA-shaped layer
   (Llama-3 8B's: hidden 4096, FFN 14336, 32 heads, 8 KV groups, bf16) at TP 1, micro-batch sizes 1 and 2,
   and the search. Then the measured profile is printed beside the analytic one (FLOPs over the GPU's
   peak x the documented efficiency) for the same device.
2. ``poseidon-run --nproc-per-node 1`` training that job for a few iterations on CUDA, with the watch.
3. Megatron-LM's own ``pretrain_gpt.py`` (unmodified, ``--mock-data``) through ``poseidon-run`` on the same
   device, when a Megatron-LM checkout is found: ``POSEIDON_MEGATRON_LM``, else ``shared/megatron-lm/
   core_v0.16.1`` in or beside the repository (the device run carries the repository's ``shared/``). On
   CUDA none of the CPU ranks' adjustments may appear (no ``CPU rank:`` line).

Needs torch with CUDA and megatron-core importable (the launcher's own requirement); without the built
Cython core it runs on the pure-Python twins (POSEIDON_PURE_PYTHON=1 is set when the core is missing).
Prints everything; exits non-zero if a step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MODEL = ["--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
         "--group-query-attention", "--num-query-groups", "8", "--swiglu", "--normalization", "RMSNorm",
         "--disable-bias-linear", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
         "--seq-length", "2048", "--max-position-embeddings", "2048", "--vocab-size", "32000", "--bf16",
         "--micro-batch-size", "1", "--global-batch-size", "4"]


def run(cmd: list[str], env: dict, timeout_s: float) -> tuple[int, str]:
    """Run and echo a command; (exit code, output)."""
    print("$ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout_s)
        code, out = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as exc:
        code, out = 124, (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    lines = [line for line in out.splitlines() if not re.search(r"UserWarning|warnings.warn", line)]
    print("\n".join(lines[-80:]))
    print(f"[exit {code} after {time.perf_counter() - start:.1f} s]\n", flush=True)
    return code, out


def compare(profile_path: str, model_args: list[str]) -> None:
    """The measured profile beside the analytic one for the same GPU and model."""
    from poseidon_plugin.runtime.inventory import _KNOWN_PEAK_TFLOPS, _PLACEHOLDER_PEAK_TFLOPS
    from poseidon_plugin.runtime.job_flags import read_job
    from poseidon_plugin.runtime.job_spec import model_spec
    from poseidon_plugin.specs import load_profile, parse_cluster
    from poseidon_plugin.specs.analytic import analytic_profile

    measured = load_profile(profile_path)
    job = read_job("scripts/pretrain_gpt.py", model_args)
    model = model_spec(job, global_batch_size=4, name=measured.model)
    import torch

    props = torch.cuda.get_device_properties(0)
    name = measured.entries[0].device_type
    peak = next((v for k, v in _KNOWN_PEAK_TFLOPS.items() if k in name), _PLACEHOLDER_PEAK_TFLOPS)
    cluster = parse_cluster({"name": "this-gpu", "device_types": [
        {"name": name, "memory_gb": props.total_memory / 2**30, "peak_tflops": peak}],
        "nodes": [{"device_type": name, "count": 1, "devices_per_node": 1}], "links": "gpu"}, "gpu_check")
    analytic = analytic_profile(cluster, model, micro_batch_sizes=tuple(sorted({e.mbs for e in measured.entries})))
    print(f"profile of one layer on {name} ({props.total_memory / 2**30:.0f} GiB, peak {peak:g} TFLOP/s assumed):")
    print(f"{'tp':>3} {'mbs':>4} {'field':<24} {'measured':>12} {'analytic':>12} {'measured/analytic':>18}")
    fields = ("forward_ms", "backward_ms", "embedding_forward_ms", "head_forward_ms", "head_backward_ms",
              "activation_bytes", "layer_params", "send_bytes")
    for entry in measured.entries:
        ref = analytic.get(entry.device_type, entry.tp, entry.mbs)
        for field in fields:
            m, a = getattr(entry, field), getattr(ref, field) if ref is not None else float("nan")
            ratio = f"{m / a:.2f}" if a else "n/a"
            print(f"{entry.tp:>3} {entry.mbs:>4} {field:<24} {m:>12.4g} {a:>12.4g} {ratio:>18}")


MEGATRON_LM_JOB = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
                   "--max-position-embeddings", "1024", "--micro-batch-size", "1", "--global-batch-size", "4",
                   "--train-iters", "4", "--lr", "1e-4", "--bf16", "--mock-data", "--tokenizer-type",
                   "NullTokenizer", "--vocab-size", "32000", "--eval-interval", "1000", "--eval-iters", "0",
                   # a GPU machine without Transformer Engine / Apex: Megatron-LM's own unfused paths
                   "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion"]


def megatron_lm_checkout() -> str | None:
    """The Megatron-LM checkout step 3 runs (None: none found)."""
    for folder in (os.environ.get("POSEIDON_MEGATRON_LM"), os.path.join(REPO, "shared", "megatron-lm", "core_v0.16.1"),
                   os.path.join(os.path.dirname(REPO), "shared", "megatron-lm", "core_v0.16.1")):
        if folder and os.path.isfile(os.path.join(folder, "pretrain_gpt.py")):
            return folder
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/poseidon-gpu-check"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    try:
        import torch
    except ImportError:
        print("torch is not importable here: the CUDA path cannot run")
        return 2
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}, "
          f"devices: {torch.cuda.device_count()}", flush=True)
    if not torch.cuda.is_available():
        print("no CUDA device: the CUDA path cannot run here")
        return 2
    from poseidon_plugin.backend import compiled

    if compiled("_dag") is None:
        env["POSEIDON_PURE_PYTHON"] = "1"
        print("compiled core not built here: using the pure-Python twins")
    job = ["scripts/pretrain_gpt.py", "--num-layers", str(args.layers), *MODEL]
    launcher = [sys.executable, "-m", "poseidon_plugin.runtime.launcher", "--nproc-per-node", "1"]
    cache = os.path.join(args.out, "profiles")
    failed = 0
    code, out = run([*launcher, *job, "--train-iters", "1", "--poseidon-dry-run", "--poseidon-profile-cache", cache,
                     "--poseidon-micro-batch-sizes", "1,2", "--poseidon-save-plan",
                     os.path.join(args.out, "plan.json")], env, 240)
    failed |= code != 0
    written = re.search(r"written to (\S+-profile\.json)", out)
    if written:
        compare(written.group(1), job[1:])
    else:
        print("no profile was written")
        failed = 1
    code, out = run([*launcher, *job, "--train-iters", str(args.iters), "--poseidon-profile-cache", cache], env, 240)
    failed |= code != 0
    summary = {"watch": re.findall(r"poseidon: (watch: .*)", out), "overhead": re.findall(r"poseidon: (overhead: .*)", out)}
    checkout = megatron_lm_checkout()
    if checkout is None:
        print("step 3 skipped: no Megatron-LM checkout (set POSEIDON_MEGATRON_LM, or carry shared/megatron-lm/"
              "core_v0.16.1)")
        failed = 1
    else:
        code, out = run([*launcher, os.path.join(checkout, "pretrain_gpt.py"), *MEGATRON_LM_JOB,
                         "--poseidon-profile-cache", cache, "--poseidon-micro-batch-sizes", "1"], env, 200)
        losses = re.findall(r"\| lm loss: ([-+\w.]+) \|", out)
        cpu_lines = re.findall(r"poseidon: CPU rank: .*", out)
        failed |= code != 0 or not losses or bool(cpu_lines)
        summary["megatron-lm"] = {"code": code, "lm loss": losses, "cpu-only lines (must be none)": cpu_lines,
                                  "watch": re.findall(r"poseidon: (watch: .*)", out)}
    print(json.dumps(summary, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
