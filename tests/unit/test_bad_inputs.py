"""Bad files and absurd sizes end in one clear line (issue 9, items 5, 6, 8, 10): the document reader,
the documented size limits, the memory reserve check and non-finite simulated times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from poseidon_plugin import cli
from poseidon_plugin.costmodel import CostModel
from poseidon_plugin.errors import InputError
from poseidon_plugin.plan import Plan
from poseidon_plugin.simulator import simulate
from poseidon_plugin.specs import documents, load_cluster, load_model, load_profile, parse_cluster
from poseidon_plugin.specs.documents import parse_document, quote, read_document

STAGE = {"forward_ms": [1.0], "backward_ms": [2.0], "send_ms": 0.1, "allreduce_ms": 0.0}
SIM_DOC = {"schedule": "1f1b", "micro_batches": 4, "stages": [STAGE, STAGE]}
CLUSTER_YAML = ("name: lab\ndevice_types: [A2-2]\nnodes: [{device_type: A2-2, count: 2}]\n"
                "links: npu\n")
# nine levels of nine aliases: 9**9 (387 million) strings once expanded
BOMB = 'l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + "".join(
    f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10))


def simulate_cli(capsys, path, *flags) -> tuple[int, str]:
    """``poseidon simulate`` in this process: its exit code and its stderr, which must be one line."""
    code = cli.main(["simulate", str(path), *flags])
    err = capsys.readouterr().err
    if code != 0:
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return code, err.strip()


def write(tmp_path, name, content) -> str:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return str(path)


# --- item 5: sizes are bounded before anything is allocated; messages quote ~80 characters ----------

def test_quote_cuts_long_values_and_never_builds_huge_reprs():
    assert quote("1f1b") == "'1f1b'"
    assert quote("x" * 5_000_000) == repr("x" * 80) + "... (5,000,000 characters)"
    assert len(quote(list(range(10**6)))) <= 84
    assert len(quote({str(i): [i] * 100 for i in range(1000)})) <= 84
    assert quote(10 ** 5000) == "<an integer of about 5,001 digits>"   # repr() would raise past 4300 digits


def test_simulate_refuses_a_trillion_micro_batches(tmp_path, capsys):
    path = write(tmp_path, "in.json", {**SIM_DOC, "micro_batches": 10**12})
    code, err = simulate_cli(capsys, path)
    assert code == 2
    assert err == (f"poseidon simulate: error: {path}: micro_batches=1000000000000 is too large: the "
                   "simulator takes at most 65,536")


def test_simulate_bounds_the_operations_before_building_the_graph():
    doc = {**SIM_DOC, "micro_batches": 60_000, "stages": [STAGE] * 10}
    with pytest.raises(InputError, match=r"the input asks for 1,200,000 forward and backward operations "
                                         r"\(2 x 10 stages x virtual_stages=1 x micro_batches=60,000\); "
                                         r"the simulator takes at most 1,048,576"):
        simulate(doc)


def test_simulate_error_for_a_5mb_schedule_is_short(tmp_path, capsys):
    path = write(tmp_path, "in.json", {**SIM_DOC, "schedule": "x" * 5_000_000})
    code, err = simulate_cli(capsys, path)
    assert code == 2 and len(err) < 300
    assert "schedule='xxxxxxxx" in err and "... (5,000,000 characters) is unknown; allowed: gpipe" in err


def test_yaml_alias_bomb_in_schedule_is_refused(tmp_path, capsys):
    path = write(tmp_path, "in.yaml", BOMB + "schedule: *l9\nmicro_batches: 2\nstages:\n"
                 "  - {forward_ms: [1], backward_ms: [1], send_ms: 0, allreduce_ms: 0}\n")
    code, err = simulate_cli(capsys, path)
    assert code == 2
    assert err == (f"poseidon simulate: error: {path}: line 1, column 5: this value is anchored (&name) "
                   "and used again through an alias (*name); Poseidon documents do not allow YAML "
                   "aliases: write the value out where it is used")


def test_yaml_alias_bomb_in_cluster_name_is_refused(tmp_path):
    path = write(tmp_path, "c.yaml", BOMB + CLUSTER_YAML.replace("name: lab", "name: *l9"))
    with pytest.raises(InputError, match=r"c\.yaml: line 1, column 5: this value is anchored .* do not "
                                         r"allow YAML aliases"):
        load_cluster(path)


def test_cluster_count_of_a_billion_is_refused(tmp_path):
    path = write(tmp_path, "c.yaml", CLUSTER_YAML.replace("count: 2", "count: 1000000000"))
    with pytest.raises(InputError, match=r"c\.yaml: nodes\[0\]\.count = 1000000000 is invalid: must be an "
                                         r"integer >= 1 and <= 1,048,576; the limits are in docs/SPECS\.md"):
        load_cluster(path)


def test_cluster_total_devices_is_bounded_but_a_million_devices_load():
    doc = {"name": "big", "device_types": ["A2-2", "A2-4"], "links": "npu",
           "nodes": [{"device_type": "A2-2", "count": 65_536}, {"device_type": "A2-4", "count": 65_536}]}
    with pytest.raises(InputError, match=r"^big: nodes\[2\]: the cluster reaches 1,048,584 devices here"):
        parse_cluster({**doc, "nodes": doc["nodes"] + [{"device_type": "A2-4", "count": 1}]}, "big")
    doc["nodes"][1]["count"] = 59_464   # 1,000,000 devices in all
    cluster = parse_cluster(doc, "big")
    assert cluster.num_devices == 1_000_000
    assert cluster.num_devices_of_type("A2-4") == 475_712
    first = next(cluster.iter_devices("A2-4"))   # lazy: the list of devices is never built here
    assert (first.index, first.node, first.local) == (524_288, 65_536, 0)


def test_cluster_total_over_the_limit_names_the_group():
    doc = {"name": "big", "device_types": ["A2-2"], "links": "npu",
           "nodes": [{"device_type": "A2-2", "count": 100_000}, {"device_type": "A2-2", "count": 100_000}]}
    with pytest.raises(InputError, match=r"^big: nodes\[1\]: the cluster reaches 1,600,000 devices here; "
                                         r"Poseidon plans clusters of at most 1,048,576 devices"):
        parse_cluster(doc, "big")


def test_model_sizes_are_bounded(tmp_path):
    doc = {"num_layers": 10**9, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
           "vocab_size": 100, "seq_length": 32, "global_batch_size": 8}
    with pytest.raises(InputError, match=r"m\.json: num_layers = 1000000000 is invalid: must be an integer "
                                         r">= 1 and <= 4,096"):
        load_model(write(tmp_path, "m.json", doc))
    with pytest.raises(InputError, match=r"--global-batch-size 1000000 is invalid: must be an integer >= 1 "
                                         r"and <= 65,536"):
        load_model("llama3-8b").with_overrides(global_batch_size=10**6)


def test_names_are_bounded(tmp_path):
    path = write(tmp_path, "c.yaml", CLUSTER_YAML.replace("name: lab", "name: " + "n" * 1000))
    with pytest.raises(InputError, match=r"c\.yaml: name = 'nnnn.*\.\.\. \(1,000 characters\) is invalid: "
                                         r"must be a non-empty string of at most 256 characters"):
        load_cluster(path)


def test_documents_over_the_size_limit_are_not_read(tmp_path, monkeypatch):
    monkeypatch.setattr(documents, "MAX_DOCUMENT_BYTES", 1000)
    path = write(tmp_path, "in.json", {**SIM_DOC, "pad": "x" * 2000})
    with pytest.raises(InputError, match=r"in\.json: the file is 2,[0-9]{3} bytes; Poseidon reads documents "
                                         r"of at most 0 MiB \(is this the right file\?\)"):
        read_document(path, "stage-level input")


# --- item 6: non-UTF-8 and deeply nested files ----------------------------------------------------

NOT_UTF8 = b'{"schedule": "\xff1f1b"}'


def test_non_utf8_stage_input(tmp_path, capsys):
    path = write(tmp_path, "in.json", NOT_UTF8)
    code, err = simulate_cli(capsys, path)
    assert code == 2
    assert err == (f"poseidon simulate: error: {path}: not UTF-8 text: byte 0xff at byte offset 14 is "
                   "invalid; save the file as UTF-8")


@pytest.mark.parametrize("loader", [load_cluster, load_model, load_profile, Plan.load])
def test_non_utf8_specs_and_plans(tmp_path, loader):
    path = write(tmp_path, "doc.yaml" if loader in (load_cluster, load_model) else "doc.json",
                 b"name: caf\xe9\n" if loader in (load_cluster, load_model) else NOT_UTF8)
    with pytest.raises(InputError, match=r"doc\.(yaml|json): not UTF-8 text: byte 0x(e9|ff) at byte offset "
                                         r"(9|14) is invalid; save the file as UTF-8"):
        loader(path)


def test_json_nested_100k_deep(tmp_path, capsys):
    path = write(tmp_path, "in.json", "[" * 100_000 + "]" * 100_000)
    code, err = simulate_cli(capsys, path)
    assert code == 2
    assert err == (f"poseidon simulate: error: {path}: nested more than 64 levels deep; Poseidon "
                   "documents need only a few levels (is this the right file?)")
    for loader in (load_profile, Plan.load):
        with pytest.raises(InputError, match=r"in\.json: nested more than 64 levels deep"):
            loader(path)


def test_yaml_nested_deep(tmp_path):
    path = write(tmp_path, "c.yaml", "name: " + "[" * 100 + "]" * 100 + "\n")
    with pytest.raises(InputError, match=r"c\.yaml: line 1, column \d+: nested more than 64 levels deep"):
        load_cluster(path)


def test_nesting_at_the_limit_is_read():
    assert parse_document("[" * 64 + "]" * 64, "x") == eval("[" * 64 + "]" * 64)
    with pytest.raises(InputError, match=r"^x: nested more than 64 levels deep"):
        parse_document("[" * 65 + "]" * 65, "x")
    with pytest.raises(InputError, match=r"^x: line 1, column \d+: nested more than 64 levels deep"):
        parse_document("- " * 64 + "[]", "x", yaml_syntax=True)


def test_huge_integer_literal(tmp_path):
    path = write(tmp_path, "m.json", '{"num_layers": ' + "9" * 5000 + "}")
    with pytest.raises(InputError, match=r"m\.json: num_layers = 9{80}\.\.\. is not allowed: integers have "
                                         r"at most 100 digits"):
        load_model(path)


def test_missing_file_and_directory(tmp_path, capsys):
    code, err = simulate_cli(capsys, tmp_path / "nope.json")
    assert code == 2 and err.endswith("cannot read stage-level input file "
                                      f"'{tmp_path / 'nope.json'}': No such file or directory")
    with pytest.raises(InputError, match=r"cannot read plan file '.*': Is a directory"):
        Plan.load(tmp_path)


# --- item 8: a device whose memory is all reserve -------------------------------------------------

def test_memory_reserve_above_device_memory_is_refused_at_load(tmp_path):
    path = write(tmp_path, "c.yaml", "name: small\ndevice_types: [{name: tiny, memory_gb: 1, "
                                     "peak_tflops: 100}]\nnodes: [{device_type: tiny}]\nlinks: npu\n")
    with pytest.raises(InputError, match=r"^.*c\.yaml: device_types: device type 'tiny' has memory_gb = 1 "
                                         r"but the memory reserve is 2\.05 GiB \(memory_reserve_gb = 2 \+ "
                                         r"memory_reserve_fraction = 0\.05 of its memory\), which leaves "
                                         r"nothing for the model; fix memory_gb .* or lower "
                                         r"constants\.memory_reserve_gb"):
        load_cluster(path)


def test_memory_reserve_is_checked_with_the_constants_in_effect():
    doc = {"name": "small", "device_types": [{"name": "tiny", "memory_gb": 1, "peak_tflops": 100}],
           "nodes": [{"device_type": "tiny"}], "links": "npu", "constants": {"memory_reserve_gb": 0.5}}
    cluster = parse_cluster(doc, "small.yaml")   # 0.5 + 5 % of 1 GiB leaves room
    model = load_model("llama3-8b")
    with pytest.raises(InputError, match=r"small\.yaml with preset llama3-8b: device type 'tiny' has "
                                         r"memory_gb = 1 but the memory reserve is 1\.05 GiB"):
        CostModel(cluster, model, constants={"memory_reserve_gb": 1.0})


# --- item 10: non-finite times, field paths, duplicate keys ----------------------------------------

def test_overflowing_times_are_rejected_not_printed_as_inf(tmp_path, capsys):
    huge = {"forward_ms": [1e308], "backward_ms": [1e308], "send_ms": 0, "allreduce_ms": 0}
    doc = {**SIM_DOC, "stages": [huge, huge]}
    path = write(tmp_path, "in.json", doc)
    code, err = simulate_cli(capsys, path, "--json", "--trace", str(tmp_path / "t.json"))
    assert code == 2 and not (tmp_path / "t.json").exists()
    assert err == (f"poseidon simulate: error: {path}: the simulated iteration time is inf ms: the input's "
                   "times add up past the largest double (about 1.8e308); give realistic times in "
                   "milliseconds")
    with pytest.raises(InputError, match=r"^the simulated iteration time is inf ms"):
        simulate(doc)


@pytest.mark.parametrize("name, text, message", [
    ("in.json", '{"schedule": "1f1b", "micro_batches": 2, "stages": [{"forward_ms": [1], "backward_ms": '
                '[NaN], "send_ms": 0, "allreduce_ms": 0}]}',
     "stages[0].backward_ms[0] = NaN is not a valid time; times must be finite numbers of milliseconds >= 0"),
    ("in.json", '{"schedule": "1f1b", "micro_batches": 2, "stages": [{"forward_ms": [1], "backward_ms": '
                '[1], "send_ms": 1e999, "allreduce_ms": 0}]}',
     "stages[0].send_ms = 1e999 is not a valid time; times must be finite numbers of milliseconds >= 0"),
    ("in.json", '{"schedule": "1f1b", "micro_batches": -Infinity, "stages": []}',
     "micro_batches = -Infinity is not allowed: numbers must be finite"),
    ("in.yaml", "schedule: 1f1b\nmicro_batches: 2\nstages:\n  - {forward_ms: [.nan], backward_ms: [1], "
                "send_ms: 0, allreduce_ms: 0}\n",
     "stages[0].forward_ms[0] = .nan is not a valid time; times must be finite numbers of milliseconds >= 0"),
    ("in.json", '{"schedule": "1f1b", "micro_batches": 2, "stages": [{"forward_ms": [1], "backward_ms": '
                '[1], "send_ms": 0, "send_ms": 1, "allreduce_ms": 0}]}',
     "stages[0]: duplicate key 'send_ms'; keep one"),
    ("in.json", '{"schedule": "1f1b", "schedule": "gpipe", "micro_batches": 2, "stages": []}',
     "duplicate key 'schedule'; keep one"),
    ("in.yaml", "schedule: 1f1b\nmicro_batches: 2\nschedule: gpipe\n",
     "line 3, column 1: duplicate key 'schedule'; keep one"),
])
def test_simulate_names_the_field_of_nan_and_duplicate_keys(tmp_path, capsys, name, text, message):
    path = write(tmp_path, name, text)
    code, err = simulate_cli(capsys, path)
    assert code == 2
    assert err == f"poseidon simulate: error: {path}: {message}"


@pytest.mark.parametrize("name, text, loader, message", [
    ("c.yaml", CLUSTER_YAML + "links: gpu\n", load_cluster, "line 5, column 1: duplicate key 'links'"),
    ("c.json", '{"name": "a", "device_types": [{"name": "X", "memory_gb": 8, "memory_gb": 16, '
               '"peak_tflops": 1}], "nodes": [], "links": "npu"}', load_cluster,
     r"device_types\[0\]: duplicate key 'memory_gb'; keep one"),
    ("c.json", '{"name": "a", "device_types": [{"name": "X", "memory_gb": Infinity, "peak_tflops": 1}], '
               '"nodes": [], "links": "npu"}', load_cluster,
     r"device_types\[0\]\.memory_gb = Infinity is not allowed: numbers must be finite"),
    ("m.yaml", "num_layers: 2\nnum_layers: 3\n", load_model, "line 2, column 1: duplicate key 'num_layers'"),
    ("p.json", '{"format": "poseidon-profile", "entries": [], "entries": []}', load_profile,
     "duplicate key 'entries'; keep one"),
    ("plan.json", '{"tp": 1, "tp": 2}', Plan.load, "duplicate key 'tp'; keep one"),
])
def test_duplicate_keys_and_nan_in_every_document(tmp_path, name, text, loader, message):
    with pytest.raises(InputError, match=rf"^{tmp_path}/{name}: {message}"):
        loader(write(tmp_path, name, text))


def test_plan_from_json_uses_the_same_reader():
    with pytest.raises(InputError, match=r"^plan\.json: duplicate key 'pp'; keep one$"):
        Plan.from_json('{"pp": 1, "pp": 2}', "plan.json")
    with pytest.raises(InputError, match=r"^plan: predicted_iteration_ms = NaN is not allowed"):
        Plan.from_json('{"predicted_iteration_ms": NaN}')


def test_yaml_keys_of_mixed_types_are_reported_not_crashed(tmp_path, capsys):
    path = write(tmp_path, "in.yaml", "1: x\nschedule: 1f1b\nbogus: 2\n")
    code, err = simulate_cli(capsys, path)
    assert code == 2 and err == (f"poseidon simulate: error: {path}: unknown field 1; allowed fields: "
                                 "schedule, micro_batches, virtual_stages, data_parallel, comm_model, "
                                 "stages")


def test_pure_python_yaml_fallback_refuses_the_same(tmp_path):
    """Without libyaml the reader uses PyYAML's pure-Python loader: same refusals, no traceback."""
    script = ("import yaml; del yaml.CSafeLoader\n"
              "from poseidon_plugin.specs.documents import parse_document\n"
              "import sys\n"
              "for text in sys.argv[1:]:\n"
              "    try: parse_document(text, 'f', yaml_syntax=True)\n"
              "    except ValueError as exc: print(exc)\n")
    texts = [BOMB + "x: *l9\n", "- " * 2000 + "x", "a: 1\na: 2\n", "a: [.inf]\n"]
    out = subprocess.run([sys.executable, "-c", script, *texts], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path, env={"PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "f: line 1, column 5: this value is anchored (&name) and used again through an alias (*name); "
        "Poseidon documents do not allow YAML aliases: write the value out where it is used",
        "f: nested too deeply (more than 64 levels)",
        "f: line 2, column 1: duplicate key 'a'; keep one",
        "f: a[0] = .inf is not allowed: numbers must be finite",
    ]
