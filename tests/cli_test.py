"""End-to-end tests of the kvsim command line: outputs, bad input, exit codes.

Run by meson test as: python3 tests/cli_test.py build/kvsim
"""
import json
import os
import signal
import subprocess
import sys
import time
import unittest

import cli_common
from cli_common import KvsimTestCase, kvsim, read

SMALL = """trace: {synthetic: policybook, name: decode-4096, max_steps: 600}
budgets: [64, 128]
policies: [sliding_window, streaming_llm, h2o, tova, snapkv]
"""


class Cli(KvsimTestCase):
    def test_run_prints_a_table_and_writes_csv_and_json(self):
        config = self.write("small.yaml", SMALL)
        out = os.path.join(self.dir, "out")
        result = kvsim("run", config, "--out", out)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("retained attention mass", result.stdout)
        self.assertIn("B=128", result.stdout)
        self.assertNotIn("\r", result.stderr)  # no progress bar when stderr is not a terminal
        records = json.loads(read(os.path.join(out, "results.json")))
        self.assertEqual(len(records), 10)
        for key in ("policy", "params", "budget", "retained_mass", "heavy_hitter_recall", "eviction_calls",
                    "policy_bytes_per_slot"):
            self.assertIn(key, records[0])
        self.assertEqual(records[0]["eviction_calls"], 600 - 64 + 1)
        csv_lines = read(os.path.join(out, "results.csv")).splitlines()
        self.assertEqual(len(csv_lines), 11)
        self.assertEqual(sorted(os.listdir(out)), ["results.csv", "results.json"])  # no temporary files left

    def test_format_json_and_csv_on_stdout(self):
        config = self.write("small.yaml", SMALL)
        result = kvsim("run", config, "--format", "json", "--out", os.path.join(self.dir, "o"), "-q")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(len(json.loads(result.stdout)), 10)
        result = kvsim("run", config, "--format", "csv", "--out", os.path.join(self.dir, "o"), "-q")
        self.assertTrue(result.stdout.startswith("policy,label,params,budget"))

    def test_results_do_not_depend_on_threads(self):
        config = self.write("small.yaml", SMALL)
        one = kvsim("run", config, "--format", "json", "--threads", "1", "--out", os.path.join(self.dir, "a"), "-q")
        two = kvsim("run", config, "--format", "json", "--threads", "2", "--out", os.path.join(self.dir, "b"), "-q")
        self.assertEqual(one.returncode, 0, one.stderr)
        self.assertEqual(one.stdout, two.stdout)

    def test_sweep_crosses_config_and_command_line_grids(self):
        config = self.write("sweep.yaml", SMALL + "grid: {snapkv.pool_kernel: [1, 7]}\n")
        result = kvsim("sweep", config, "--budgets", "64,96,128", "--set", "h2o.recent_window=8,16,32",
                       "--format", "json", "--out", os.path.join(self.dir, "o"), "-q")
        self.assertEqual(result.returncode, 0, result.stderr)
        records = json.loads(result.stdout)
        # (sliding + streaming + tova) x 3 budgets + h2o 3 windows x 3 + snapkv 2 kernels x 3 = 24
        self.assertEqual(len(records), 24)
        labels = {r["label"] for r in records}
        self.assertIn("h2o(recent_window=8)", labels)
        self.assertIn("snapkv(pool_kernel=1)", labels)
        self.assertEqual({r["budget"] for r in records}, {64, 96, 128})

    def test_trace_synth_info_and_replay_from_file(self):
        trace = os.path.join(self.dir, "d.h5")
        result = kvsim("trace", "synth", "policybook", "--name", "decode-4096", "-o", trace)
        self.assertEqual(result.returncode, 0, result.stderr)
        info = kvsim("trace", "info", trace)
        self.assertEqual(info.returncode, 0, info.stderr)
        self.assertIn("kvsim-trace version 1", info.stdout)
        self.assertIn("policybook/decode-4096, seed 7", info.stdout)
        self.assertIn("4096 tokens", info.stdout)
        from_file = self.write("file.yaml", "trace: d.h5\nbudgets: [256]\npolicies: [streaming_llm]\n")
        result = kvsim("run", from_file, "--format", "json", "--out", os.path.join(self.dir, "o"), "-q")
        self.assertEqual(result.returncode, 0, result.stderr)
        record = json.loads(result.stdout)[0]
        self.assertEqual(round(record["retained_mass"], 6), 0.736691)
        self.assertEqual(round(record["heavy_hitter_recall"], 6), 0.859419)

    def test_policybook_config_reproduces_the_published_baselines(self):
        result = kvsim("run", "configs/policybook.yaml", "--format", "json",
                       "--out", os.path.join(self.dir, "o"), "-q")
        self.assertEqual(result.returncode, 0, result.stderr)
        got = {(r["label"], r["budget"]): (round(r["retained_mass"], 6), round(r["heavy_hitter_recall"], 6))
               for r in json.loads(result.stdout)}
        self.assertEqual(len(got), 21)
        self.assertEqual(got[("sliding_window", 512)], (0.655518, 0.774107))
        self.assertEqual(got[("streaming_llm", 1024)], (0.866203, 0.927572))

    def test_bad_config_inputs(self):
        out = os.path.join(self.dir, "out")
        self.assert_input_error(kvsim("run", os.path.join(self.dir, "missing.yaml"), "--out", out),
                                "missing.yaml: no such file")
        bad = self.write("bad.yaml", "trace: {synthetic: policybook}\nbudgets: [0]\npolicies: [h2o]\n")
        self.assert_input_error(kvsim("run", bad, "--out", out), "bad.yaml:2: budgets[0]: must be >= 1")
        unknown = self.write("unknown.yaml", "trace: {synthetic: policybook}\nbudgets: [8]\npolicies: [lru]\n")
        self.assert_input_error(kvsim("run", unknown, "--out", out), "unknown.yaml:3", "unknown policy 'lru'")
        wrong_type = self.write("type.yaml", "trace: {synthetic: policybook}\nbudgets: [8]\npolicies: {h2o: 1}\n")
        self.assert_input_error(kvsim("run", wrong_type, "--out", out), "type.yaml:3: policies")
        self.assertFalse(os.path.exists(out))  # nothing written

    def test_bad_trace_files(self):
        out = os.path.join(self.dir, "out")
        garbage = self.write("garbage.h5", "definitely not HDF5\n")
        config = self.write("g.yaml", "trace: garbage.h5\nbudgets: [8]\npolicies: [h2o]\n".replace("[8]", "[64]"))
        self.assert_input_error(kvsim("run", config, "--out", out), "garbage.h5: not an HDF5 file")
        self.assert_input_error(kvsim("trace", "info", garbage), "garbage.h5: not an HDF5 file")
        # A real trace cut short.
        trace = os.path.join(self.dir, "d.h5")
        self.assertEqual(kvsim("trace", "synth", "policybook", "-o", trace).returncode, 0)
        cut = os.path.join(self.dir, "cut.h5")
        with open(trace, "rb") as f, open(cut, "wb") as g:
            g.write(f.read()[: os.path.getsize(trace) // 3])
        config = self.write("c.yaml", "trace: cut.h5\nbudgets: [64]\npolicies: [h2o]\n")
        self.assert_input_error(kvsim("run", config, "--out", out), "cut.h5")
        self.assertFalse(os.path.exists(out))

    def test_adakv_wraps_a_scored_policy(self):
        listed = kvsim("policies")
        self.assertIn("adakv", listed.stdout)
        self.assertIn("Feng et al. 2024", listed.stdout)
        out = os.path.join(self.dir, "out")
        base = "trace: {synthetic: qkv, name: tiny-256}\nbudgets: [24]\nmetrics: [output_rel_error, bytes_per_token]\npolicies:\n"
        good = self.write("ada.yaml", base + "  - {evict: {h2o: {recent_window: 4}}, adakv: {floor: 0.5}}\n"
                                             "  - {evict: {snapkv: {recent_window: 4}}, adakv: {}, quantize: {bits: 8}}\n")
        one = kvsim("run", good, "--format", "json", "--threads", "1", "--out", os.path.join(self.dir, "a"), "-q")
        two = kvsim("run", good, "--format", "json", "--threads", "2", "--out", os.path.join(self.dir, "b"), "-q")
        self.assertEqual(one.returncode, 0, one.stderr)
        self.assertEqual(one.stdout, two.stdout)
        labels = [r["label"] for r in json.loads(one.stdout)]
        self.assertEqual(labels, ["h2o(recent_window=4)+adakv(floor=0.5)", "snapkv(recent_window=4)+adakv+int8"])
        floor = self.write("floor.yaml", base + "  - {evict: h2o, adakv: {floor: 1.5}}\n")
        self.assert_input_error(kvsim("run", floor, "--out", out),
                                "floor.yaml:5: policies[0].h2o.adakv.floor: must be between 0 and 1, got 1.5")
        unknown = self.write("unknown.yaml", base + "  - {evict: lru, adakv: {}}\n")
        self.assert_input_error(kvsim("run", unknown, "--out", out), "unknown.yaml:5: policies[0].lru", "unknown policy 'lru'")
        unscored = self.write("unscored.yaml", base + "  - {evict: sliding_window, adakv: {floor: 0.2}}\n")
        self.assert_input_error(kvsim("run", unscored, "--out", out), "unscored.yaml:5: policies[0].sliding_window",
                                "adakv selects by a scored eviction policy's scores")
        key = self.write("key.yaml", base + "  - {evict: h2o, adakv: {flor: 0.2}}\n")
        self.assert_input_error(kvsim("run", key, "--out", out), "key.yaml:5: policies[0].h2o.adakv",
                                "unknown parameter 'flor' for policy adakv")
        alone = self.write("alone.yaml", base + "  - adakv\n")
        self.assert_input_error(kvsim("run", alone, "--out", out), "alone.yaml:5: policies[0].adakv",
                                "write {evict: h2o, adakv: {floor: 0.2}}")
        self.assertFalse(os.path.exists(out))

    def test_bad_precision_inputs(self):
        out = os.path.join(self.dir, "out")
        base = "trace: {synthetic: qkv, name: tiny-256}\nbudgets: [48]\npolicies:\n"
        bits = self.write("bits.yaml", base + "  - {evict: h2o, quantize: {bits: 3}}\n")
        self.assert_input_error(kvsim("run", bits, "--out", out), "bits.yaml:4: policies[0].h2o.quantize.bits: must be 4 or 8, got 3")
        group = self.write("group.yaml", base + "  - {int4: {value_group: 6}}\n")
        self.assert_input_error(kvsim("run", group, "--out", out), "value_group 6 does not divide the head size 16")
        zero = self.write("zero.yaml", base + "  - {int8: {key_group: 0}}\n")
        self.assert_input_error(kvsim("run", zero, "--out", out), "policies[0].int8.key_group: must be >= 1, got 0")
        shares = self.write("shares.yaml", base + "  - {stratigraphic: {int8_share: 0.5, int4_share: 0.4}}\n")
        self.assert_input_error(kvsim("run", shares, "--out", out), "shares sum to 1.2 > 1")
        self.write("heads.tsv", "1\t0\n0\t0\n")
        pattern = self.write("pattern.yaml", base + "  - {streaming_attention: {pattern: heads.tsv}}\n")
        self.assert_input_error(kvsim("run", pattern, "--out", out), "heads.tsv: 2 rows, but the trace has 3 layers")
        values = self.write("values.yaml", "trace: {synthetic: policybook, max_steps: 100}\nbudgets: [48]\n"
                                           "policies: [int8]\nmetrics: [output_rel_error]\n")
        self.assert_input_error(kvsim("run", values, "--out", out), "need a Q/K/V trace")
        self.assertFalse(os.path.exists(out))

    def test_lowrank_and_group_heads(self):
        trace = self.path("tiny.h5")
        self.assertEqual(kvsim("trace", "synth", "qkv", "--name", "tiny-256", "-o", trace).returncode, 0)
        bases = self.path("bases.json")
        result = kvsim("trace", "bases", trace, "-o", bases)
        self.assertEqual(result.returncode, 0, result.stderr)
        out = self.path("out")
        base = "trace: tiny.h5\nbudgets: [48]\nmetrics: [output_rel_error, bytes_per_token]\npolicies:\n"
        config = self.write("ok.yaml", base + "  - {lowrank: {key_rank: 16, value_rank: 16, bases: bases.json}}\n"
                                              "  - {lowrank: {key_rank: 4, value_rank: 4, bases: bases.json}}\n"
                                              "  - {group_heads: {group: 2}}\n"
                                              "  - {evict: h2o, project: {lowrank: {key_rank: 4, bases: bases.json}}}\n")
        result = kvsim("run", config, "--out", self.path("ok-out"), "--format", "json")
        self.assertEqual(result.returncode, 0, result.stderr)
        records = {r["label"]: r for r in json.loads(result.stdout)}
        self.assertEqual(records["lowrank(key_rank=16,value_rank=16,bases=bases.json)"]["output_rel_error"], 0)
        self.assertGreater(records["lowrank(bases=bases.json)"]["output_rel_error"], 0)
        self.assertEqual(records["group_heads"]["bytes_per_token"], 32)  # 2 heads share 64 bytes of fp16 K and V
        composed = records["h2o+lowrank(bases=bases.json)"]
        self.assertGreater(composed["output_rel_error"], records["lowrank(bases=bases.json)"]["output_rel_error"])

        zero = self.write("zero.yaml", base + "  - {lowrank: {key_rank: 0, bases: bases.json}}\n")
        self.assert_input_error(kvsim("run", zero, "--out", out), "zero.yaml:5: policies[0].lowrank.key_rank: must be >= 1, got 0")
        high = self.write("high.yaml", base + "  - {evict: h2o, project: {lowrank: {value_rank: 17, bases: bases.json}}}\n")
        self.assert_input_error(kvsim("run", high, "--out", out), "policies[0].project.lowrank.value_rank: value_rank = 17 "
                                                                  "must be in 1..16")
        other = self.path("stories-bases.json")
        self.assertEqual(kvsim("trace", "bases", os.path.abspath("data/tinystories-stories260K.h5"),
                               "--sequences", "0", "-o", other).returncode, 0)
        shape = self.write("shape.yaml", base + "  - {lowrank: {bases: stories-bases.json}}\n")
        self.assert_input_error(kvsim("run", shape, "--out", out), "stories-bases.json: bases of 5 layers x 4 KV heads x "
                                                                   "head size 8, but the trace has 3 x 2 x 16")
        odd = self.write("odd.yaml", base + "  - {group_heads: {group: 3}}\n")
        self.assert_input_error(kvsim("run", odd, "--out", out), "group = 3 must divide the trace's 2 KV heads")
        self.assertFalse(os.path.exists(out))
        # Fitting bases needs keys and values; nothing is written when it fails.
        attention = self.path("attention.h5")
        self.assertEqual(kvsim("trace", "synth", "policybook", "-o", attention).returncode, 0)
        self.outputs = ("b2.json",)
        self.assert_input_error(kvsim("trace", "bases", attention, "-o", self.path("b2.json")),
                                "attention.h5: bases are fitted on keys and values")
        self.assert_input_error(kvsim("trace", "bases", trace, "--pre-rope-theta", "-1", "-o", self.path("b2.json")),
                                "--pre-rope-theta: must be a positive number")
        # Keys before RoPE: the shipped trace predates the recorded RoPE, so it needs the base.
        self.assert_input_error(kvsim("trace", "bases", os.path.abspath("data/tinystories-stories260K.h5"), "--pre-rope",
                                      "-o", self.path("b2.json")),
                                "keys before RoPE need the model's RoPE, which this trace does not record")

    def test_bad_flags(self):
        config = self.write("small.yaml", SMALL)
        self.assertEqual(kvsim("run", config, "--format", "xml").returncode, 2)
        self.assertEqual(kvsim("run", config, "--bogus").returncode, 2)
        self.assertEqual(kvsim("frobnicate").returncode, 2)
        self.assert_input_error(kvsim("sweep", config, "--budgets", "64,x"), "--budgets: 'x' is not a budget")
        self.assert_input_error(kvsim("sweep", config, "--set", "h2o.recent_window"), "--set")
        self.assert_input_error(kvsim("sweep", config, "--set", "lru.size=1,2"), "policy 'lru' is not among")
        self.assert_input_error(kvsim("trace", "synth", "policybook", "--name", "decode-1", "-o",
                                      os.path.join(self.dir, "x.h5")), "unknown policybook trace 'decode-1'")
        self.assertFalse(os.path.exists(os.path.join(self.dir, "x.h5")))
        self.assertEqual(kvsim("--version").returncode, 0)


class Help(KvsimTestCase):
    def commands(self, *parent):
        """The subcommands `kvsim [parent] --help` lists."""
        out = kvsim(*parent, "--help").stdout
        listed = out.split("Subcommands:", 1)[1] if "Subcommands:" in out else ""
        return [line.split()[0] for line in listed.splitlines() if line.startswith("  ") and line.split()]

    def test_every_command_points_to_an_existing_guide(self):
        # A user who asks a command for help is sent to the page of docs/ for that task; a new
        # command without one, or a page renamed under it, fails here.
        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        top = self.commands()
        self.assertIn("run", top)
        self.assertIn("README.md links them all", kvsim("--help").stdout)
        checked = 0
        for command in top:
            for path in [[command]] + [[command, sub] for sub in self.commands(command)]:
                out = kvsim(*path, "--help")
                self.assertEqual(out.returncode, 0, path)
                guide = [line for line in out.stdout.splitlines() if line.startswith("Guide: ")]
                self.assertEqual(len(guide), 1, f"kvsim {' '.join(path)} --help names no guide")
                for page in guide[0][len("Guide: "):].split(", "):
                    self.assertTrue(os.path.isfile(os.path.join(root, page)), f"{' '.join(path)}: {page}")
                checked += 1
        self.assertGreaterEqual(checked, 14)


class HostileInput(KvsimTestCase):
    """Input an adversarial user gives: each gets one line naming the file and key, exit 2, and
    nothing half-written; none crashes, hangs, wraps an integer or is silently ignored."""

    outputs = ("out",)

    def setUp(self):
        super().setUp()
        self.out = self.path("out")

    def tearDown(self):
        self.assertFalse(os.path.exists(self.out))  # no results from any failed run
        super().tearDown()

    def config(self, name, body, trace="trace: {synthetic: policybook, max_steps: 100}\n"):
        return self.write(name, trace + body)

    def test_integers_are_range_checked_before_narrowing(self):
        wrap = self.config("wrap.yaml", "budgets: [4294967297]\npolicies: [h2o]\n")
        self.assert_input_error(kvsim("run", wrap, "--out", self.out), "wrap.yaml:2: budgets[0]: 4294967297 is too large")
        prefill = self.config("prefill.yaml", "budgets: [8]\npolicies: [h2o]\nprefill_tokens: 4294967306\n")
        self.assert_input_error(kvsim("run", prefill, "--out", self.out), "prefill.yaml:4: prefill_tokens: 4294967306 is too large")
        k = self.config("k.yaml", "budgets: [8]\npolicies: [h2o]\nmetrics: [{heavy_hitter_recall: {k: 4294967296}}]\n")
        self.assert_input_error(kvsim("run", k, "--out", self.out), "k.yaml:4", "4294967296 is too large")
        steps = self.write("steps.yaml", "trace: {synthetic: policybook, max_steps: 1e300}\nbudgets: [8]\npolicies: [h2o]\n")
        self.assert_input_error(kvsim("run", steps, "--out", self.out), "steps.yaml:1: trace.max_steps", "too large")
        profile = self.config("profile.yaml", "layer_budgets: [8, 9e9]\npolicies: [h2o]\n")
        self.assert_input_error(kvsim("run", profile, "--out", self.out), "layer_budgets[1]: 9e9 is too large")
        small = self.config("small.yaml", "budgets: [8]\npolicies: [h2o]\n")
        for budget in ("2147483647", "4294967297", "-1", "99999999999999999999"):
            self.assert_input_error(kvsim("sweep", small, "--budgets", budget, "--out", self.out),
                                    "--budgets: '" + budget + "' is not a budget")

    def test_yaml_keys_are_plain_and_unique(self):
        for name, text, fragment in [
            ("complex.yaml", "? [a, b]\n: 1\nbudgets: [8]\npolicies: [h2o]\n", "complex.yaml:1: a key must be a plain name"),
            ("flow.yaml", "trace: { {x}}\nbudgets: [8]\npolicies: [h2o]\n", "flow.yaml:1: a key must be a plain name"),
            ("dup.yaml", "budgets: [8]\npolicies: [h2o]\nbudgets: [16]\n", "dup.yaml:3: duplicate key 'budgets'"),
            ("dup2.yaml", "budgets: [8]\npolicies: [{h2o: {recent_window: 2, recent_window: 4}}]\n", "duplicate key 'recent_window'"),
        ]:
            self.assert_input_error(kvsim("run", self.write(name, text), "--out", self.out), fragment)

    def test_paths_that_are_not_regular_files(self):
        self.assert_input_error(kvsim("run", self.dir, "--out", self.out), self.dir + ": is a directory")
        fifo = os.path.join(self.dir, "fifo.yaml")
        os.mkfifo(fifo)
        result = subprocess.run([cli_common.KVSIM, "run", fifo, "--out", self.out], capture_output=True, text=True, timeout=30)
        self.assert_input_error(result, "fifo.yaml: is a FIFO, not a regular file")
        trace_fifo = os.path.join(self.dir, "fifo.h5")
        os.mkfifo(trace_fifo)
        result = subprocess.run([cli_common.KVSIM, "trace", "info", trace_fifo], capture_output=True, text=True, timeout=30)
        self.assert_input_error(result, "fifo.h5: is a FIFO, not a regular file")
        self.assert_input_error(kvsim("trace", "info", self.dir), self.dir + ": is a directory")
        long_name = os.path.join(self.dir, "x" * 300 + ".yaml")
        self.assert_input_error(kvsim("run", long_name, "--out", self.out), "File name too long")
        os.mkdir(os.path.join(self.dir, "profiles"))
        profile_dir = self.config("pdir.yaml", "layer_budgets: profiles\npolicies: [h2o]\n")
        self.assert_input_error(kvsim("run", profile_dir, "--out", self.out), "profiles: is a directory")
        self.write("heads.tsv", "")
        pattern_dir = self.write("sdir.yaml", "trace: {synthetic: qkv, name: tiny-256}\nbudgets: [48]\n"
                                              "policies: [{streaming_attention: {pattern: profiles}}]\n")
        self.assert_input_error(kvsim("run", pattern_dir, "--out", self.out), "profiles: is a directory")

    def test_empty_values_are_refused_not_ignored(self):
        config = self.config("c.yaml", "budgets: [8]\npolicies: [h2o]\n")
        result = kvsim("sweep", config, "--budgets", "", "--out", self.out)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertIn("--budgets: an empty value was given", result.stderr)
        result = kvsim("run", config, "--out", "")
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertIn("--out: an empty value was given", result.stderr)
        empty = self.config("empty.yaml", "layer_budgets: []\npolicies: [h2o]\n")
        self.assert_input_error(kvsim("run", empty, "--out", self.out), "empty.yaml:2: layer_budgets: empty list")
        no_dir = self.config("nodir.yaml", "budgets: [8]\npolicies: [h2o]\noutput: {dir: ''}\n")
        self.assert_input_error(kvsim("run", no_dir), "nodir.yaml:4: output.dir: empty folder name")
        self.assert_input_error(kvsim("--max-memory", "lots", "run", config, "--out", self.out),
                                "--max-memory: 'lots' is not a size")

    def interrupt_trace_synth(self, signal_number):
        target = os.path.join(self.dir, "big.h5")
        process = subprocess.Popen([cli_common.KVSIM, "trace", "synth", "qkv", "--name", "llama-1b-4096", "-o", target],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        temp = os.path.join(self.dir, ".big.h5.tmp-%d" % process.pid)
        deadline = time.monotonic() + 60
        while not os.path.exists(temp) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        self.assertTrue(os.path.exists(temp), "the temporary file never appeared")
        time.sleep(0.3)  # well inside writing: the synthetic trace takes seconds
        process.send_signal(signal_number)
        process.wait(timeout=60)
        self.assertEqual(process.returncode, -signal_number)
        self.assertEqual(os.listdir(self.dir), [])  # neither the trace nor its temporary file

    def test_interrupted_writes_leave_nothing(self):
        self.interrupt_trace_synth(signal.SIGINT)
        self.interrupt_trace_synth(signal.SIGTERM)

    def test_temporary_files_of_dead_processes_are_removed_by_the_next_write(self):
        dead = subprocess.Popen(["true"])
        dead.wait()
        stale = self.write(".old.h5.tmp-%d" % dead.pid, "half a trace")
        live = self.write(".mine.h5.tmp-%d" % os.getpid(), "another process still writing")
        other = self.write(".notes.tmp-x", "not ours")
        result = kvsim("trace", "synth", "policybook", "-o", os.path.join(self.dir, "d.h5"))
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertFalse(os.path.exists(stale))
        self.assertTrue(os.path.exists(live))
        self.assertTrue(os.path.exists(other))


SHARED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared")
MODEL = os.path.join(SHARED, "models", "stories260K", "stories260K.gguf")
STORIES = os.path.join(SHARED, "text", "tinystories_sample.txt")


@unittest.skipUnless(os.path.exists(MODEL), "../shared/models/stories260K is not present")
class ModelCli(KvsimTestCase):
    def test_capture_records_provenance_and_replays(self):
        trace = os.path.join(self.dir, "t.h5")
        result = kvsim("capture", "--model", MODEL, "--text", STORIES, "--split-on", "<|endoftext|>",
                       "--context", "512", "--dtype", "float16", "-o", trace)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("5 sequences", result.stdout)
        info = kvsim("trace", "info", trace).stdout
        self.assertIn("270cba1bd5109f42d03350f60406024560464db173c0e387d91f0426d3bd256d", info)
        self.assertIn("5 layers, 8 query heads, 4 KV heads, head size 8", info)
        config = self.write("c.yaml", "trace: t.h5\nbudgets: [32]\npolicies: [sliding_window, tova]\n"
                                      "output: {per_layer: true}\n")
        run = kvsim("run", config, "--format", "json", "--out", os.path.join(self.dir, "o"), "-q")
        self.assertEqual(run.returncode, 0, run.stderr)
        records = json.loads(run.stdout)
        self.assertEqual(len(records), 2 + 2 * 5)  # overall + per layer
        self.assertEqual({r.get("layer") for r in records if "layer" in r}, {0, 1, 2, 3, 4})

    def test_eval_reports_ppl_delta_and_correlation(self):
        config = self.write("e.yaml", "budgets: [16, 48]\npolicies: [sliding_window, streaming_llm, tova]\n")
        out = os.path.join(self.dir, "o")
        result = kvsim("eval", config, "--model", MODEL, "--text", STORIES, "--split-on", "<|endoftext|>",
                       "--context", "512", "--max-tokens", "160", "--format", "json", "--out", out, "-q")
        self.assertEqual(result.returncode, 0, result.stderr)
        records = json.loads(result.stdout)
        self.assertEqual(records[0]["policy"], "full")
        self.assertEqual(records[0]["delta_ppl"], 0)
        self.assertGreater(records[0]["ppl"], 2.5)
        self.assertLess(records[0]["ppl"], 5.0)
        self.assertEqual(len(records), 1 + 3 * 2)
        for r in records[1:]:
            self.assertAlmostEqual(r["delta_ppl"], r["ppl"] - records[0]["ppl"], places=9)
        # A smaller cache never helps the attention-free policies here.
        by = {(r["label"], r["budget"]): r for r in records[1:]}
        self.assertGreater(by[("sliding_window", 16)]["ppl"], by[("sliding_window", 48)]["ppl"])
        self.assertGreater(by[("sliding_window", 16)]["ppl"], records[0]["ppl"])
        correlation = json.loads(read(os.path.join(out, "correlation.json")))
        self.assertEqual(correlation["configurations"], 6)
        self.assertLess(correlation["spearman_retained_mass_vs_delta_ppl"], 0)

    def test_eval_quantised_and_streaming_caches_in_the_loop(self):
        config = self.write("q.yaml", "budgets: [48]\npolicies:\n  - int8\n  - int4\n"
                                      "  - {streaming_attention: {recent: 44, lambda: 0.9}}\n"
                                      "  - {evict: sliding_window, quantize: {bits: 4, older_than: 16}}\n"
                                      "  - sliding_window\n")
        result = kvsim("eval", config, "--model", MODEL, "--text", STORIES, "--split-on", "<|endoftext|>",
                       "--context", "512", "--max-tokens", "200", "--format", "json",
                       "--out", os.path.join(self.dir, "o"), "-q")
        self.assertEqual(result.returncode, 0, result.stderr)
        by = {r["label"]: r for r in json.loads(result.stdout)}
        full = by["full"]
        # INT8 in the loop costs next to nothing; INT4 costs more; both really change the model.
        self.assertLess(abs(by["int8"]["delta_ppl"]), 0.02)
        self.assertGreater(by["int4"]["delta_ppl"], abs(by["int8"]["delta_ppl"]))
        self.assertNotEqual(by["int8"]["ppl"], full["ppl"])
        self.assertLess(by["int8"]["output_rel_error"], by["int4"]["output_rel_error"])
        self.assertEqual(full["compression_ratio"], 1.0)
        self.assertGreater(by["int4"]["compression_ratio"], by["int8"]["compression_ratio"])
        self.assertGreater(by["int8"]["compression_ratio"], 1.0)
        # Quantising what the sliding window keeps saves memory and costs perplexity.
        composed = by["sliding_window+int4(older_than=16)"]
        self.assertGreater(composed["compression_ratio"], by["sliding_window"]["compression_ratio"])
        self.assertGreater(composed["ppl"], by["sliding_window"]["ppl"])
        self.assertGreater(by["streaming_attention(recent=44,lambda=0.9)"]["delta_ppl"], 0)

    def test_eval_refuses_value_groups_that_do_not_fit_the_head_size(self):
        # stories260K's head size is 8: a group of 3 leaves a ragged group, which kvsim run, search
        # and the runtime refuse, so eval does too (it quantised the ragged group before).
        out = os.path.join(self.dir, "o")
        config = self.write("ragged.yaml", "budgets: [48]\npolicies:\n  - {int4: {value_group: 3}}\n")
        result = kvsim("eval", config, "--model", MODEL, "--text", STORIES, "--split-on", "<|endoftext|>",
                       "--context", "512", "--max-tokens", "100", "--out", out, "-q")
        self.assertEqual(result.returncode, 2, result.stderr)
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        self.assertEqual(errors, ["kvsim: error: int4(value_group=3): value_group 3 does not divide the head size 8 "
                                  "of model " + MODEL], result.stderr)
        self.assertFalse(os.path.exists(out))

    def test_bad_model_and_text_inputs(self):
        out = os.path.join(self.dir, "out")
        cut = self.write("cut.gguf", open(MODEL, "rb").read()[:5000], "wb")
        config = self.write("e.yaml", "budgets: [16]\npolicies: [tova]\n")
        result = kvsim("capture", "--model", cut, "--text", STORIES, "-o", os.path.join(self.dir, "x.h5"))
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertIn("cut.gguf", result.stderr)
        self.assertEqual(len(result.stderr.strip().splitlines()), 1)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "x.h5")))
        foreign = self.write("foreign.gguf", "this is not a model\n")
        result = kvsim("eval", config, "--model", foreign, "--text", STORIES, "--out", out)
        self.assertEqual(result.returncode, 2)
        self.assertIn("foreign.gguf", result.stderr)
        empty = self.write("empty.txt", "  \n<|endoftext|>\n")
        result = kvsim("eval", config, "--model", MODEL, "--text", empty, "--split-on", "<|endoftext|>", "--out", out)
        self.assertEqual(result.returncode, 2)
        self.assertIn("empty.txt: empty text", result.stderr)
        self.assertFalse(os.path.exists(out))
        # Longer than the context: a warning naming the file, then the run goes on at the limit.
        result = kvsim("capture", "--model", MODEL, "--text", STORIES, "--split-on", "<|endoftext|>",
                       "--context", "64", "-o", os.path.join(self.dir, "short.h5"))
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("warning: " + STORIES, result.stderr)
        self.assertIn("stopping at 64", result.stderr)
        # A run metric that needs the model.
        replay = self.write("r.yaml", "trace: {synthetic: policybook, max_steps: 100}\nbudgets: [16]\n"
                                      "policies: [tova]\nmetrics: [ppl]\n")
        result = kvsim("run", replay, "--out", out)
        self.assertEqual(result.returncode, 2)
        self.assertIn("ppl needs the model in the loop", result.stderr)


if __name__ == "__main__":
    cli_common.KVSIM = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
