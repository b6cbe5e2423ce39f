"""`kvsim report DIR`: figures (.dat, .gp, .svg, .png) and report.md from a results folder, drawn by
gnuplot; bad input is one error line, exit status 2, and no plots/ folder.

Run by meson test as: python3 tests/cli_report_test.py build/kvsim
The search.json and profile.json fixtures follow the schemas `kvsim search` writes.
"""
import json
import os
import shutil
import subprocess
import sys
import unittest
import xml.etree.ElementTree as ElementTree

import cli_common
from cli_common import KvsimTestCase, kvsim, read

HAVE_GNUPLOT = shutil.which("gnuplot") is not None
NEEDS_GNUPLOT = unittest.skipUnless(HAVE_GNUPLOT, "gnuplot is not installed (apt-get install gnuplot-nox): "
                                                  "rendering tests skipped")

# A replay with memory measured (a Q/K/V trace): every figure is against bytes per token.
QKV_RUN = """trace: {synthetic: qkv, name: tiny-256}
budgets: [32, 64]
policies: [full, int8, sliding_window, h2o: {recent_window: 8}]
metrics: [retained_mass, output_rel_error, bytes_per_token]
"""
# An attention trace measures no bytes: every figure is against the budget.
ATTENTION_RUN = """trace: {synthetic: policybook, max_steps: 300}
budgets: [48, 64, 128]
policies: [sliding_window, h2o, tova]
"""


def record(label, bytes_per_token, mass, error, **extra):
    return dict({"policy": label, "label": label, "params": {}, "budget": 64, "retained_mass": mass,
                 "heavy_hitter_recall": 0.5, "output_rel_error": error, "output_cosine": 0.9,
                 "bytes_per_token": bytes_per_token, "compression_ratio": 32.0 / bytes_per_token}, **extra)


# Hand-checked fronts. Retained mass (higher is better) by bytes: b@10 0.6 beats a@10 0.5; b@15
# 0.6 does not improve on it; a@20 0.7 does; c@25 0.65 does not; b@30 0.9 does. Output error
# (lower is better): b@10 0.25, b@15 0.1, a@20 0.2 no, c@25 0.15 no, b@30 0.05.
PARETO_RECORDS = [
    record("a", 10, 0.5, 0.3),
    record("a", 20, 0.7, 0.2),
    record("b", 10, 0.6, 0.25),
    record("b", 15, 0.6, 0.1),
    record("b", 30, 0.9, 0.05),
    record("c", 25, 0.65, 0.15),
    record("c", 1, None, None),          # not measured: not plotted
    record("a", 5, 0.99, 0.0, layer=0),  # a per-layer record: not plotted, not on the front
]

SEARCH = {"format": "kvsim-search", "version": 1, "trace": "data/tinystories-stories260K.h5",
          "objective": "output_rel_error", "records": [
              {"method": "fitted layer budgets", "fit": "layer_budgets", "target": "2x",
               "objective": "output_rel_error", "bytes_per_token": 61.2, "compression_ratio": 2.01,
               "heldout": 0.1234, "fitting": 0.1201, "delta_ppl": None},
              {"method": "fitted layer budgets", "fit": "layer_budgets", "target": "4x",
               "objective": "output_rel_error", "bytes_per_token": 30.5, "compression_ratio": 4.02,
               "heldout": 0.2345, "fitting": 0.2201, "delta_ppl": None},
              {"method": "uniform budget", "fit": "none", "target": "2x",
               "objective": "output_rel_error", "bytes_per_token": 62.0, "compression_ratio": 1.98,
               "heldout": 0.1500, "fitting": 0.1490, "delta_ppl": 0.02},
              {"method": "uniform budget", "fit": "none", "target": "4x",
               "objective": "output_rel_error", "bytes_per_token": 31.0, "compression_ratio": 3.96,
               "heldout": None, "fitting": 0.2600, "delta_ppl": None}]}

PROFILE = {"format": "kvsim-profile", "version": 1, "name": "stories260K-h2o-2x",
           "model": {"name": "stories260K", "num_layers": 5, "num_query_heads": 8, "num_kv_heads": 4, "head_dim": 8},
           "policy": {"name": "h2o", "params": {"recent_window": 8}},
           "layer_budgets": [40, 52, 60, 70, 80],
           "head_budgets": [[40, 38, 41, 41], [50, 52, 54, 52], [60, 61, 59, 60], [70, 71, 69, 70], [80, 80, 81, 79]],
           "expected": {"bytes_per_token": 61.2, "compression_ratio": 2.01},
           "heldout": {"objective": "output_rel_error", "value": 0.1234}}
# The profiles of the other fits are for the policies that read them (every command takes the same
# profiles: search/profile.h), with no budgets beside.
STREAMING_PROFILE = dict(PROFILE, name="stories260K-streaming_attention-streaming-2x",
                         policy={"name": "streaming_attention", "params": {}}, layer_budgets=None, head_budgets=None,
                         streaming={"sinks": 4, "recent": 16,
                                    "heads": [[0, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 1], [1, 0, 1, 0], [0, 0, 0, 0]],
                                    "lambda": [[0.99, 0.93, 0.95, 0.97]] * 5})
TIERS_PROFILE = dict(PROFILE, name="stories260K-stratigraphic-tiers-2x", policy={"name": "stratigraphic", "params": {}},
                     layer_budgets=None, head_budgets=None,
                     tiers={"fp16": [[0.1, 0.2, 0.0, 0.35]] * 5, "int8": [[0.3] * 4] * 5, "int4": [[0.2] * 4] * 5})
for fixture in (STREAMING_PROFILE, TIERS_PROFILE):
    for key in [k for k, v in fixture.items() if v is None]:
        del fixture[key]

# A mixed profile (version 3): each head its own method and level, on a 2-layer, 2-head shape.
MIXED_PROFILE = {"format": "kvsim-profile", "version": 3, "name": "tiny-mixed-2x",
                 "model": {"name": "tiny", "num_layers": 2, "num_query_heads": 2, "num_kv_heads": 2, "head_dim": 8},
                 "policy": {"name": "mixed", "params": {}},
                 "mixed": {"method": [["evict", "tiers"], ["streaming", "full"]],
                           "evict": {"policy": "h2o", "params": {"recent_window": 8}, "budgets": [[64, 0], [0, 0]]},
                           "tiers": {"params": {"recent": 16}, "fp16": [[0, 0.1], [0, 0]], "int8": [[0, 0.3], [0, 0]],
                                     "int4": [[0, 0.2], [0, 0]]},
                           "streaming": {"sinks": 4, "recent": 16, "lambda": [[0, 0], [0.5, 0]],
                                         "stateless": [[0, 0], [0, 0]]}}}

PROFILE_FIGURES = ["profile-layer_budgets", "profile-head_budgets"]
STREAMING_FIGURES = ["profile-streaming-2x-streaming-heads", "profile-streaming-2x-streaming-lambda"]


def dat_blocks(path):
    """The .dat file's blocks by the label in their `# index N: LABEL` line: lists of (x, y)."""
    blocks, label = {}, None
    for line in read(path).splitlines():
        if line.startswith("# index "):
            label = line.split(": ", 1)[1]
            blocks[label] = []
        elif line and not line.startswith("#"):
            x, y = line.split()[:2]
            blocks[label].append((float(x), float(y)))
    return blocks


class Report(KvsimTestCase):
    outputs = ("results/plots",)

    def results_folder(self, records=None, search=None, profile=None):
        folder = self.path("results")
        os.makedirs(folder, exist_ok=True)
        for name, content in (("results.json", records), ("search.json", search), ("profile.json", profile)):
            if content is not None:
                self.write(os.path.join("results", name), content if isinstance(content, str) else json.dumps(content))
        return folder

    def assert_figure(self, plots, name):
        for ext in (".dat", ".gp", ".svg", ".png"):
            path = os.path.join(plots, name + ext)
            self.assertTrue(os.path.isfile(path) and os.path.getsize(path) > 0, path)
        root = ElementTree.parse(os.path.join(plots, name + ".svg")).getroot()
        self.assertEqual(root.tag, "{http://www.w3.org/2000/svg}svg")
        with open(os.path.join(plots, name + ".png"), "rb") as png:
            self.assertEqual(png.read(8), b"\x89PNG\r\n\x1a\n")
        self.assertIn("(%s.svg)" % name, read(os.path.join(plots, "report.md")))

    def assert_nothing_written(self, folder):
        self.assertEqual([n for n in os.listdir(folder) if "plots" in n], [])

    @NEEDS_GNUPLOT
    def test_a_qkv_run_is_plotted_against_bytes_per_token(self):
        out = self.path("run")
        result = kvsim("run", self.write("qkv.yaml", QKV_RUN), "--out", out, "-q")
        self.assertEqual(result.returncode, 0, result.stderr)
        result = kvsim("report", out)
        self.assertEqual(result.returncode, 0, result.stderr)
        plots = os.path.join(out, "plots")
        for name in ("results-retained_mass", "results-output_rel_error", "results-output_cosine",
                     "results-compression_ratio", "results-heavy_hitter_recall"):
            self.assert_figure(plots, name)
        self.assertFalse(os.path.exists(os.path.join(plots, "results-ppl.dat")))  # not measured by run
        gp = read(os.path.join(plots, "results-retained_mass.gp"))
        self.assertIn('"results-retained_mass.dat"', gp)
        self.assertIn("set xlabel 'bytes per token", gp)
        blocks = dat_blocks(os.path.join(plots, "results-retained_mass.dat"))
        self.assertEqual(list(blocks)[:4], ["full", "int8", "sliding_window", "h2o(recent_window=8)"])
        self.assertIn("Pareto front (higher is better)", blocks)
        # full keeps all the mass at the most bytes; int8 too, at fewer: the full cache is not on the front.
        records = json.loads(read(os.path.join(out, "results.json")))
        full_bytes = next(r["bytes_per_token"] for r in records if r["policy"] == "full")
        self.assertNotIn(full_bytes, [x for x, _ in blocks["Pareto front (higher is better)"]])
        self.assertEqual(sorted(os.listdir(out)), ["plots", "results.csv", "results.json"])  # no staging folder left

    @NEEDS_GNUPLOT
    def test_an_attention_run_is_plotted_against_the_budget(self):
        out = self.path("run")
        result = kvsim("run", self.write("attention.yaml", ATTENTION_RUN), "--out", out, "-q")
        self.assertEqual(result.returncode, 0, result.stderr)
        result = kvsim("report", out)
        self.assertEqual(result.returncode, 0, result.stderr)
        plots = os.path.join(out, "plots")
        self.assert_figure(plots, "results-retained_mass")
        self.assert_figure(plots, "results-heavy_hitter_recall")
        self.assertEqual(sorted(n for n in os.listdir(plots) if n.endswith(".gp")),
                         ["results-heavy_hitter_recall.gp", "results-retained_mass.gp"])
        self.assertIn("set xlabel 'budget", read(os.path.join(plots, "results-retained_mass.gp")))
        blocks = dat_blocks(os.path.join(plots, "results-retained_mass.dat"))
        self.assertEqual([x for x, _ in blocks["tova"]], [48, 64, 128])

    @NEEDS_GNUPLOT
    def test_pareto_fronts_of_a_hand_checked_case(self):
        folder = self.results_folder(records=PARETO_RECORDS)
        result = kvsim("report", folder)
        self.assertEqual(result.returncode, 0, result.stderr)
        plots = os.path.join(folder, "plots")
        mass = dat_blocks(os.path.join(plots, "results-retained_mass.dat"))
        self.assertEqual(mass["Pareto front (higher is better)"], [(10, 0.6), (20, 0.7), (30, 0.9)])
        self.assertEqual(mass["a"], [(10, 0.5), (20, 0.7)])  # the per-layer record is left out
        self.assertEqual(mass["c"], [(25, 0.65)])  # the null value is left out
        error = dat_blocks(os.path.join(plots, "results-output_rel_error.dat"))
        self.assertEqual(error["Pareto front (lower is better)"], [(10, 0.25), (15, 0.1), (30, 0.05)])

    @NEEDS_GNUPLOT
    def test_search_and_profile_fixtures(self):
        folder = self.results_folder(search=SEARCH, profile=PROFILE)
        result = kvsim("report", folder)
        self.assertEqual(result.returncode, 0, result.stderr)
        plots = os.path.join(folder, "plots")
        for name in ["search-heldout"] + PROFILE_FIGURES:
            self.assert_figure(plots, name)
        blocks = dat_blocks(os.path.join(plots, "search-heldout.dat"))
        self.assertEqual(blocks["fitted layer budgets"], [(30.5, 0.2345), (61.2, 0.1234)])
        self.assertEqual(blocks["uniform budget"], [(62.0, 0.15)])  # a null held-out value is left out
        heads = read(os.path.join(plots, "profile-head_budgets.dat"))
        self.assertIn("\n3 0 41\n", heads)  # KV head 3 of layer 0
        self.assertIn("\n3 4 79\n", heads)
        report = read(os.path.join(plots, "report.md"))
        self.assertIn("stories260K-h2o-2x", report)
        self.assertEqual(report.count("!["), 1 + len(PROFILE_FIGURES))

        # A search folder's profile per fit and target is drawn too, named by its file.
        for name, content in (("profile-tiers-2x.json", TIERS_PROFILE), ("profile-streaming-2x.json", STREAMING_PROFILE)):
            with open(os.path.join(folder, name), "w") as f:
                json.dump(content, f)
        result = kvsim("report", folder)
        self.assertEqual(result.returncode, 0, result.stderr)
        for zone in ("fp16", "int8", "int4"):
            self.assert_figure(plots, "profile-tiers-2x-tiers-" + zone)
        for name in STREAMING_FIGURES:
            self.assert_figure(plots, name)
        self.assertIn("\n3 0 0.35\n", read(os.path.join(plots, "profile-tiers-2x-tiers-fp16.dat")))
        self.assertIn("\n1 0 1\n", read(os.path.join(plots, "profile-streaming-2x-streaming-heads.dat")))
        self.assertIn("stories260K-stratigraphic-tiers-2x", read(os.path.join(plots, "report.md")))

    @NEEDS_GNUPLOT
    def test_a_mixed_profile_is_one_map_of_methods(self):
        folder = self.results_folder(profile=MIXED_PROFILE)
        result = kvsim("report", folder)
        self.assertEqual(result.returncode, 0, result.stderr)
        plots = os.path.join(folder, "plots")
        self.assert_figure(plots, "profile-mixed-method")
        # One cell per head: KV head, layer, the method's colour index, its level as a data string.
        cells = [line for line in read(os.path.join(plots, "profile-mixed-method.dat")).splitlines()
                 if line and not line.startswith("#")]
        self.assertEqual(cells, ['0 0 0 "64 tokens"', '1 0 1 "10/30/20%"', '0 1 2 "lambda 0.5"', '1 1 3 "fp16"'])
        script = read(os.path.join(plots, "profile-mixed-method.gp"))
        self.assertIn('set cbtics ("evict" 0, "tiers" 1, "streaming" 2, "full" 3)', script)
        self.assertIn("set title 'mixed.method of tiny-mixed-2x'", script)

    @NEEDS_GNUPLOT
    def test_the_scripts_redraw_by_hand_and_a_new_report_replaces_the_old(self):
        folder = self.results_folder(profile=PROFILE)
        self.assertEqual(kvsim("report", folder).returncode, 0)
        plots = os.path.join(folder, "plots")
        self.write("results/plots/stale.svg", "<svg/>")
        os.remove(os.path.join(plots, "profile-head_budgets.svg"))
        subprocess.run(["gnuplot", "profile-head_budgets.gp"], cwd=plots, check=True)
        self.assertGreater(os.path.getsize(os.path.join(plots, "profile-head_budgets.svg")), 0)
        result = kvsim("report", folder)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertFalse(os.path.exists(os.path.join(plots, "stale.svg")))
        self.assert_figure(plots, "profile-head_budgets")
        self.assertEqual(sorted(os.listdir(folder)), ["plots", "profile.json"])

    @NEEDS_GNUPLOT
    def test_a_killed_report_s_staging_folder_is_removed_by_the_next(self):
        folder = self.results_folder(profile=PROFILE)
        stale = os.path.join(folder, ".plots.tmp-999999999")  # above any pid_max: no such process
        os.makedirs(os.path.join(stale, "sub"))
        self.write("results/.plots.tmp-999999999/sub/half.svg", "<svg")
        result = kvsim("report", folder)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(sorted(os.listdir(folder)), ["plots", "profile.json"])

    def test_no_gnuplot_is_one_error_line(self):
        folder = self.results_folder(records=PARETO_RECORDS)
        result = subprocess.run([cli_common.KVSIM, "report", folder], capture_output=True, text=True,
                                env=dict(os.environ, PATH=self.dir))
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertEqual(result.stderr, "kvsim: error: gnuplot not found (apt-get install gnuplot-nox)\n")
        self.assert_nothing_written(folder)

    def test_bad_input(self):
        self.assert_input_error(kvsim("report", self.path("missing")), self.path("missing") + ": no such folder")
        folder = self.results_folder()
        self.assert_input_error(kvsim("report", folder), folder + ": no results.json, search.json or profile.json")
        results = os.path.join(folder, "results.json")
        cases = [
            ("[{\"label\": \"a\",", [results + ": not valid JSON"]),
            ("[{\"label\": \"a\", \"budget\": 1" + "3" * 400 + "}]", [results + ": not valid JSON"]),  # past double
            ("{\"label\": \"a\"}", [results + ": not a JSON list of records"]),
            (json.dumps(PARETO_RECORDS[:3] + [dict(record("b", 10, 0.5, 0.1), bytes_per_token="10")]),
             [results + ": record 3: 'bytes_per_token' is not a number"]),
            (json.dumps([record("b", 10, [0.5], 0.1)]), [results + ": record 0: 'retained_mass' is not a number"]),
            (json.dumps([dict(record("b", 10, 0.5, 0.1), label=7)]), [results + ": record 0: 'label' is not a string"]),
            (json.dumps([dict(record("b", 10, 0.5, 0.1), layer="0")]), ["record 0: 'layer' is not a number"]),
            (json.dumps([{"policy": "b", "label": "b", "budget": 8, "retained_mass": None},
                         dict(record("b", 10, 0.5, 0.1), layer=0)]),
             [folder + ": nothing to plot"]),
        ]
        for text, fragments in cases:
            with self.subTest(text=text[:40]):
                self.write("results/results.json", text)
                self.assert_input_error(kvsim("report", folder), *fragments)
                self.assert_nothing_written(folder)
        os.remove(results)

        search = os.path.join(folder, "search.json")
        bad_record = dict(SEARCH["records"][0], heldout="0.1")
        for content, fragments in [
            (dict(SEARCH, format="kvsim-profile"), [search + ": 'format' is not \"kvsim-search\""]),
            (dict(SEARCH, version=2), [search + ": 'version' is not 1"]),
            (dict(SEARCH, records=[SEARCH["records"][0], bad_record]), [search + ": record 1: 'heldout' is not a number"]),
        ]:
            with self.subTest(content=fragments[0]):
                self.write("results/search.json", json.dumps(content))
                self.assert_input_error(kvsim("report", folder), *fragments)
                self.assert_nothing_written(folder)
        os.remove(search)

        profile = os.path.join(folder, "profile.json")
        for content, fragments in [
            (dict(PROFILE, head_budgets=PROFILE["head_budgets"][:4]), [profile + ": head_budgets: expected 5 entries, got 4"]),
            (dict(TIERS_PROFILE, tiers=dict(TIERS_PROFILE["tiers"], fp16=[[0.3, 0.3, 0.3]] * 5)),
             [profile + ": tiers.fp16[0]: expected 4 entries, got 3"]),
            (dict(STREAMING_PROFILE, streaming=dict(STREAMING_PROFILE["streaming"], **{"lambda": [[0.9, 0.9, "x", 0.9]] * 5})),
             [profile + ": streaming.lambda[0][2]: expected a number"]),
            (dict(TIERS_PROFILE, tiers=dict(TIERS_PROFILE["tiers"], **{"../fp16": [[0.3] * 4] * 5})),
             [profile + ": 'tiers' has a key '../fp16'"]),
            (dict(PROFILE, model={"name": "x", "num_layers": 5}), [profile + ": model.num_query_heads: missing"]),
            (dict(PROFILE, layer_budgets=[1, 2]), [profile + ": layer_budgets: expected 5 entries, got 2"]),
            # What no other command takes, report does not plot (once it drew these).
            (dict(PROFILE, streaming=STREAMING_PROFILE["streaming"]),
             [profile + ": streaming: streaming heads are for policy streaming_attention, not h2o"]),
            (dict(TIERS_PROFILE, streaming=STREAMING_PROFILE["streaming"]), [profile + ": streaming: beside tiers"]),
        ]:
            with self.subTest(content=fragments[0]):
                self.write("results/profile.json", json.dumps(content))
                self.assert_input_error(kvsim("report", folder), *fragments)
                self.assert_nothing_written(folder)

    @NEEDS_GNUPLOT  # the check comes after the one for gnuplot
    def test_a_file_where_the_plots_folder_goes_is_refused(self):
        folder = self.results_folder(records=PARETO_RECORDS)
        self.write("results/plots", "not a folder")
        result = kvsim("report", folder)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertIn("plots: exists and is not a folder", result.stderr)
        self.assertEqual(read(os.path.join(folder, "plots")), "not a folder")


if __name__ == "__main__":
    cli_common.KVSIM = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
