"""Results a user can trust at a glance: default metrics that fit the policies, per-sequence
records, fractions inside their range, budgets only where one applies, and what the attention
view changes.

Run by meson test as: python3 tests/cli_results_test.py build/kvsim
"""
import csv
import io
import json
import math
import os
import shutil
import sys
import unittest

import cli_common
from cli_common import KvsimTestCase, kvsim, read

TRACE = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data",
                                     "tinystories-stories260K.h5"))
SHARED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared")
MODEL = os.path.join(SHARED, "models", "stories260K", "stories260K.gguf")
STORIES = os.path.join(SHARED, "text", "tinystories_sample.txt")
NAMES = ["tinystories_sample-%d" % i for i in range(5)]

# The shipped trace, each story cut to its first 48 decode steps: quick, and still five stories.
SHORT = "trace: {path: %s, max_steps: 48}\n" % TRACE
PRECISION = SHORT + "budgets: [32]\npolicies: [full, int8, int4, stratigraphic, sliding_window]\n"


class Results(KvsimTestCase):
    def run_json(self, config, *flags):
        out = os.path.join(self.dir, "out")
        result = kvsim("run", config, "--out", out, "-q", *flags)
        self.assertEqual(result.returncode, 0, result.stderr)
        return result, json.loads(read(os.path.join(out, "results.json")))

    def test_default_metrics_on_a_qkv_trace_with_quantised_policies_are_output_error_and_compression(self):
        result, records = self.run_json(self.write("p.yaml", PRECISION))
        self.assertIn("relative L2 error", result.stdout)
        self.assertIn("compression ratio", result.stdout)
        self.assertNotIn("retained attention mass", result.stdout)
        self.assertNotIn("note:", result.stderr)
        by = {r["label"]: r for r in records}
        self.assertEqual(by["full"]["output_rel_error"], 0.0)
        self.assertGreater(by["int4"]["output_rel_error"], by["int8"]["output_rel_error"])
        self.assertGreater(by["int4"]["compression_ratio"], by["int8"]["compression_ratio"])
        self.assertIn("output_rel_error", by["sliding_window"])  # measured for eviction rows too

    def test_default_metrics_on_an_attention_trace_stay_mass_and_recall_and_say_why(self):
        config = self.write("a.yaml", "trace: {synthetic: policybook, name: decode-4096, max_steps: 300}\n"
                                      "budgets: [64]\npolicies: [int8, h2o]\n")
        result, _ = self.run_json(config)
        self.assertIn("retained attention mass", result.stdout)
        self.assertIn("heavy-hitter recall", result.stdout)
        self.assertIn("kvsim: note:", result.stderr)
        self.assertIn("records attention only", result.stderr)
        # Eviction alone keeps today's defaults, with nothing to note.
        config = self.write("e.yaml", SHORT + "budgets: [32]\npolicies: [full, {h2o: {recent_window: 8}}]\n")
        result, _ = self.run_json(config)
        self.assertIn("retained attention mass", result.stdout)
        self.assertNotIn("relative L2 error", result.stdout)
        self.assertEqual(result.stderr, "")

    def test_metrics_a_config_names_are_kept(self):
        result, _ = self.run_json(self.write("n.yaml", PRECISION + "metrics: [retained_mass]\n"))
        self.assertIn("retained attention mass", result.stdout)
        self.assertNotIn("relative L2 error", result.stdout)

    def test_per_sequence_records_name_each_story_and_leave_the_pooled_records_alone(self):
        config = SHORT + "budgets: [16, 2x]\npolicies: [int8, {h2o: {recent_window: 8}}, sliding_window]\n" \
                         "metrics: [retained_mass, output_rel_error, compression_ratio]\n"
        _, pooled = self.run_json(self.write("a.yaml", config))
        result, records = self.run_json(self.write("b.yaml", config + "output: {per_sequence: true}\n"))
        self.assertEqual(records[:len(pooled)], pooled)  # to the last digit
        split = records[len(pooled):]
        self.assertEqual(len(split), 5 * len(pooled))
        self.assertEqual([r["sequence"] for r in split[:5]], [{"index": i, "name": NAMES[i]} for i in range(5)])
        for r in pooled:
            self.assertNotIn("sequence", r)
            mine = [s for s in split if (s["label"], s["budget_label"]) == (r["label"], r["budget_label"])]
            self.assertEqual(len(mine), 5)
            self.assertEqual(sum(s["steps"] for s in mine), r["steps"])
        self.assertIn("retained attention mass (mean over steps, before eviction), by sequence", result.stdout)
        for name in NAMES:
            self.assertIn(name, result.stdout)
        self.assertIn("h2o(recent_window=8) @ 2x", result.stdout)
        rows = list(csv.DictReader(io.StringIO(read(os.path.join(self.dir, "out", "results.csv")))))
        self.assertEqual(rows[0]["sequence"], "all")
        self.assertEqual(rows[len(pooled)]["sequence"], "0")
        self.assertEqual(rows[len(pooled)]["sequence_name"], NAMES[0])
        # Per-sequence records, like the pooled ones, do not depend on the thread count.
        _, one_thread = self.run_json(self.write("b.yaml", config + "output: {per_sequence: true}\n"), "--threads", "1")
        self.assertEqual(one_thread, records)
        # A selection of sequences keeps each one's index in the trace.
        result, records = self.run_json(self.write("c.yaml", config.replace("max_steps: 48", "max_steps: 48, sequences: [4, 2]")
                                                   + "output: {per_sequence: true}\n"))
        self.assertEqual(records[len(pooled)]["sequence"], {"index": 4, "name": NAMES[4]})
        self.assertEqual(records[len(pooled) + 1]["sequence"], {"index": 2, "name": NAMES[2]})

    def test_a_budget_is_null_where_none_applies(self):
        config = self.write("b.yaml", SHORT + "budgets: [16, 2x]\npolicies: [full, int8, {h2o: {recent_window: 8}}]\n"
                                              "metrics: [retained_mass]\noutput: {per_sequence: true}\n")
        _, records = self.run_json(config)
        pooled = [r for r in records if "sequence" not in r]
        self.assertEqual([(r["label"], r["budget"], r["budget_label"]) for r in pooled],
                         [("full", None, "full"), ("int8", None, "full"), ("h2o(recent_window=8)", 16, "16"),
                          ("h2o(recent_window=8)", None, "2x")])
        per_story = [r["budget"] for r in records if "sequence" in r and r["budget_label"] == "2x"]
        self.assertEqual(len(per_story), 5)
        self.assertTrue(all(isinstance(b, int) and b > 0 for b in per_story))
        rows = list(csv.DictReader(io.StringIO(read(os.path.join(self.dir, "out", "results.csv")))))
        self.assertEqual([(r["label"], r["budget"]) for r in rows[:4]],
                         [("full", ""), ("int8", ""), ("h2o(recent_window=8)", "16"), ("h2o(recent_window=8)", "")])

    def test_fractions_never_leave_their_range(self):
        config = self.write("f.yaml", "trace: %s\nbudgets: [32]\npolicies: [full, int8, sliding_window]\n"
                                      "metrics: [retained_mass, heavy_hitter_recall, output_cosine]\n"
                                      "output: {per_sequence: true}\n" % TRACE)
        result, records = self.run_json(config)
        for r in records:
            for key in ("retained_mass", "heavy_hitter_recall"):
                self.assertGreaterEqual(r[key], 0.0)
                self.assertLessEqual(r[key], 1.0)
            self.assertLessEqual(r["output_cosine"], 1.0)
        self.assertEqual(records[0]["label"], "full")
        self.assertEqual(records[0]["retained_mass"], 1.0)  # the float sum came to 1.0000000029538971
        self.assertNotIn("1.0000000", read(os.path.join(self.dir, "out", "results.csv")))

    def test_policies_and_run_help_say_what_the_attention_view_changes(self):
        for args in (["policies"], ["run", "--help"]):
            result = kvsim(*args)
            self.assertEqual(result.returncode, 0, result.stderr)
            text = " ".join(result.stdout.split())
            self.assertIn("The view changes only what a policy is shown", text)
            self.assertIn("retained mass and recall are measured on the full softmax in every view", text)

    def test_the_cached_view_shows_a_policy_the_attention_of_its_cache_as_held(self):
        # Stratigraphic sinks tokens by the attention it is shown: computed from the keys at their
        # tiers it sinks others than from the trace's keys, while a policy that keeps by position
        # (sliding window) or keeps everything (int8) holds the same cache in both views.
        views = {}
        for view in ("renormalized", "cached"):
            config = ("trace: {path: %s, max_steps: 160}\nbudgets: [32]\nattention_view: %s\n"
                      "policies: [full, int8, int4, sliding_window, {stratigraphic: {recent: 16}}]\n" % (TRACE, view))
            _, records = self.run_json(self.write(view + ".yaml", config))
            views[view] = {r["label"].split("(")[0]: r for r in records}
        for label in ("full", "int8", "int4", "sliding_window"):
            self.assertEqual(views["cached"][label]["output_rel_error"], views["renormalized"][label]["output_rel_error"], label)
        self.assertNotEqual(views["cached"]["stratigraphic"]["output_rel_error"],
                            views["renormalized"]["stratigraphic"]["output_rel_error"])
        # An attention-only trace holds no keys to compute it from.
        bad = self.write("bad.yaml", "trace: {synthetic: policybook}\nbudgets: [64]\npolicies: [h2o]\nattention_view: cached\n")
        self.assert_input_error(kvsim("run", bad, "--out", os.path.join(self.dir, "out")),
                                "bad.yaml: attention_view: cached", "records attention only")
        bad = self.write("bad.yaml", SHORT + "budgets: [8]\npolicies: [h2o]\nattention_view: kept\n")
        self.assert_input_error(kvsim("run", bad, "--out", os.path.join(self.dir, "out")),
                                "bad.yaml:4: attention_view: expected raw, renormalized or cached, got 'kept'")

    @unittest.skipUnless(shutil.which("gnuplot"), "gnuplot is not installed")
    def test_report_plots_the_pooled_records_of_a_per_sequence_run(self):
        config = self.write("r.yaml", SHORT + "budgets: [16]\npolicies: [int8, sliding_window]\n"
                                              "output: {per_sequence: true}\n")
        self.run_json(config)
        result = kvsim("report", os.path.join(self.dir, "out"))
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("2 whole-trace records", read(os.path.join(self.dir, "out", "plots", "report.md")))

    def test_bad_per_sequence_value_names_the_key(self):
        config = self.write("bad.yaml", SHORT + "budgets: [16]\npolicies: [h2o]\noutput: {per_sequence: 2}\n")
        self.assert_input_error(kvsim("run", config, "--out", os.path.join(self.dir, "out")),
                                "bad.yaml:4: output.per_sequence: expected true or false")


@unittest.skipUnless(os.path.exists(MODEL), "../shared/models/stories260K is not present")
class EvalResults(KvsimTestCase):
    def eval_json(self, config):
        out = os.path.join(self.dir, "out")
        result = kvsim("eval", config, "--model", MODEL, "--text", STORIES, "--split-on", "<|endoftext|>",
                       "--context", "512", "--max-tokens", "96", "--out", out, "-q")
        self.assertEqual(result.returncode, 0, result.stderr)
        return result, json.loads(read(os.path.join(out, "results.json")))

    def test_eval_reports_ppl_and_delta_per_sequence_and_keeps_the_pooled_figures(self):
        config = "budgets: [24]\npolicies: [sliding_window, int8]\n"
        _, pooled = self.eval_json(self.write("a.yaml", config))
        result, records = self.eval_json(self.write("b.yaml", config + "output: {per_sequence: true}\n"))
        self.assertEqual(records[:len(pooled)], pooled)
        self.assertEqual(pooled[0]["label"], "full")
        self.assertIsNone(pooled[0]["budget"])
        split = records[len(pooled):]
        self.assertEqual(len(split), 5 * len(pooled))
        full = {r["sequence"]["index"]: r["ppl"] for r in split if r["label"] == "full"}
        self.assertEqual(sorted(full), list(range(5)))
        for r in split:
            self.assertEqual(r["sequence"]["name"], NAMES[r["sequence"]["index"]])
            self.assertTrue(math.isfinite(r["ppl"]))
            self.assertAlmostEqual(r["delta_ppl"], r["ppl"] - full[r["sequence"]["index"]], places=12)
        # The stories differ: one pooled perplexity hides a spread.
        self.assertGreater(max(full.values()) - min(full.values()), 0.1)
        self.assertIn("perplexity rise over the full cache, by sequence", result.stdout)
        # The correlation counts configurations, not records.
        self.assertEqual(json.loads(read(os.path.join(self.dir, "out", "correlation.json")))["configurations"], 2)
        self.assertIn("across 2 configurations", result.stdout)

    def test_eval_default_metrics_fit_the_policies(self):
        result, _ = self.eval_json(self.write("q.yaml", "budgets: [24]\npolicies: [sliding_window, int4]\n"))
        for title in ("perplexity with the policy", "perplexity rise", "relative L2 error", "compression ratio"):
            self.assertIn(title, result.stdout)
        self.assertNotIn("retained attention mass", result.stdout)
        result, _ = self.eval_json(self.write("e.yaml", "budgets: [24]\npolicies: [sliding_window]\n"))
        self.assertIn("retained attention mass", result.stdout)
        self.assertNotIn("relative L2 error", result.stdout)


if __name__ == "__main__":
    cli_common.KVSIM = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
