"""Hostile input and hostile conditions: no text read from a file or given as a name ever runs as
a command (gnuplot scripts, Slurm scripts); deeply nested JSON is one error line in every reader;
a failed write to standard output is an error; an output folder changes as a unit and has one
writer at a time; merge and --resume refuse partials whose numbers the frame rules out.

Run by meson test as: python3 tests/cli_integrity_test.py build/kvsim
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import unittest

import cli_common
from cli_common import KvsimTestCase, kvsim, read

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
TRACE = os.path.join(ROOT, "data", "tinystories-stories260K.h5")
SHARED = os.path.join(ROOT, "..", "shared")
MODEL = os.path.join(SHARED, "models", "stories260K", "stories260K.gguf")
STORIES = os.path.join(SHARED, "text", "tinystories_sample.txt")
HAVE_GNUPLOT = shutil.which("gnuplot") is not None
NEEDS_GNUPLOT = unittest.skipUnless(HAVE_GNUPLOT, "gnuplot is not installed (apt-get install gnuplot-nox)")

# A replay that takes a fraction of a second: the synthetic policybook trace, 64 steps.
TINY_SWEEP = """trace: {synthetic: policybook, max_steps: 64}
budgets: [48, 64]
policies: [sliding_window, h2o]
"""

MARKER = "pwned"  # what every injected command would create, in the folder it runs in

# Every shell metacharacter, quote and expansion, each carrying a command that would create MARKER.
SHELL_NAMES = [
    "$(touch pwned)", "`touch pwned`", ";touch pwned;", "|touch pwned", "&touch pwned&", "&&touch pwned",
    "||touch pwned", ">pwned", "<pwned", "'", "\"", "\\", " space ", "*", "?", "[a]", "{a,b}", "~", "!",
    "#hash", "%percent", "$HOME", "${IFS}touch${IFS}pwned", "a'$(touch pwned)'b", "a\"$(touch pwned)\"b",
    "\\$(touch pwned)",
]


def sbatch_directive_words(line):
    """The words sbatch takes from an #SBATCH line: a backslash takes the next character as it is,
    quotes group, an unescaped '#' starts a comment (as Slurm's _get_argument reads them)."""
    words, word, quote, escaped, started = [], "", None, False, False
    for c in line:
        if escaped:
            word, escaped, started = word + c, False, True
        elif c == "\\":
            escaped, started = True, True
        elif quote:
            if c == quote:
                quote = None
            else:
                word += c
        elif c in "\"'":
            quote, started = c, True
        elif c == "#":
            break
        elif c.isspace():
            if started:
                words.append(word)
            word, started = "", False
        else:
            word, started = word + c, True
    if started:
        words.append(word)
    return words


class SlurmScriptQuoting(KvsimTestCase):
    """Names with every shell metacharacter in the config's name, the output folder and the script's
    path: the emitted script, run under bash with sbatch and srun stubbed, submits, runs its array
    task and its merge with the names intact, and no injected command runs."""

    def stub_scheduler(self):
        bin_dir = self.path("bin")
        os.makedirs(bin_dir, exist_ok=True)
        log = self.path("sbatch.log")
        with open(os.path.join(bin_dir, "sbatch"), "w") as f:
            # Each call's arguments, NUL-separated, one call a line; prints a job id.
            f.write("#!/bin/bash\nprintf '%%s\\0' \"$@\" >> %s\necho >> %s\necho 1001\n" % (log, log))
        with open(os.path.join(bin_dir, "srun"), "w") as f:
            f.write("#!/bin/sh\ntouch %s/srun-was-called\n" % self.dir)
        for name in ("sbatch", "srun"):
            os.chmod(os.path.join(bin_dir, name), 0o755)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["PATH"] = bin_dir + os.pathsep + env["PATH"]
        return env, log

    def assert_no_marker(self):
        for folder, _, files in os.walk(self.dir):
            self.assertNotIn(MARKER, files, "an injected command ran in " + folder)
        self.assertFalse(os.path.exists(self.path("srun-was-called")))

    def test_every_metacharacter_in_every_name_stays_a_name(self):
        env, log = self.stub_scheduler()
        for i, name in enumerate(SHELL_NAMES):
            with self.subTest(name=name):
                case = self.path("case%d" % i)
                os.makedirs(case)
                config = os.path.join(case, "c" + name + ".yaml")
                with open(config, "w") as f:
                    f.write(TINY_SWEEP)
                out = os.path.join(case, "o" + name)
                script = os.path.join(case, "s" + name + ".sbatch")
                emitted = kvsim("sweep", config, "--out", out, "--emit-slurm", script, "--shards", "2", cwd=case)
                self.assertEqual(emitted.returncode, 0, emitted.stderr)
                # Submitted, then its array tasks and its merge run as Slurm runs them: the injected
                # commands would run here.
                if os.path.exists(log):
                    os.remove(log)
                submitted = subprocess.run(["bash", script], env=env, capture_output=True, text=True, cwd=case)
                tasks = [subprocess.run(["bash", script], capture_output=True, text=True, cwd=case,
                                        env=dict(env, SLURM_ARRAY_JOB_ID="1001", SLURM_ARRAY_TASK_ID=task,
                                                 SLURM_JOB_ID="2000"))
                         for task in ("1", "0")]
                merged = subprocess.run(["bash", script, "merge"], env=dict(env, SLURM_JOB_ID="1002"),
                                        capture_output=True, text=True, cwd=case)
                self.assert_no_marker()

                # And every name arrived intact: sbatch's arguments, the array tasks' and the merge's.
                for ran in [submitted] + tasks + [merged]:
                    self.assertEqual(ran.returncode, 0, ran.stderr)
                calls = [c.split("\0") for c in read(log).split("\0\n") if c]
                self.assertEqual(calls[0], ["--parsable", os.path.realpath(script)])
                self.assertIn("--output=" + out.replace("%", "%%") + "/slurm-merge-%A.out", calls[1])
                self.assertEqual(calls[1][-2:], [os.path.realpath(script), "merge"])
                self.assertTrue(os.path.isfile(os.path.join(out, "results.csv")), os.listdir(case))
                text = read(script)
                output_line = next(l for l in text.splitlines() if l.startswith("#SBATCH --output="))
                self.assertEqual(sbatch_directive_words(output_line[len("#SBATCH "):]),
                                 ["--output=" + out.replace("%", "%%") + "/slurm-%A_%a.out"])
                job_line = next(l for l in text.splitlines() if l.startswith("#SBATCH --job-name="))
                self.assertRegex(job_line, r"^#SBATCH --job-name=[A-Za-z0-9._-]+$")

    def test_a_line_break_in_any_name_is_refused(self):
        config = self.write("tiny.yaml", TINY_SWEEP)
        self.write("bad\nname.yaml", TINY_SWEEP)
        script = self.path("s.sbatch")
        cases = [
            ((self.path("bad\nname.yaml"), "--out", self.path("o"), "--emit-slurm", script), "the argument"),
            ((config, "--out", self.path("o\ntouch pwned"), "--emit-slurm", script), "the output folder"),
            ((config, "--out", self.path("o"), "--emit-slurm", self.path("s\ntouch pwned\n.sbatch")),
             "the script's path"),
            ((config, "--out", self.path("o\rx"), "--emit-slurm", script), "the output folder"),
        ]
        for args, fragment in cases:
            with self.subTest(what=fragment):
                result = kvsim("sweep", *args, "--shards", "2", cwd=self.dir)
                self.assert_input_error(result, fragment, "line break")
                self.assertFalse(os.path.exists(script))
                self.assertFalse(os.path.exists(self.path("s\ntouch pwned\n.sbatch")))
        self.assert_no_marker()



def hostile(field):
    """A string for `field` that would run a command if any of its forms reached a shell or a
    gnuplot string unescaped: backquotes (gnuplot's and the shell's), $(...), quotes, a backslash,
    a line break, a gnuplot macro."""
    return field + " `touch pwned` $(touch pwned) ' \" \\ @x \n `touch pwned`"


class ReportScripts(KvsimTestCase):
    """Every text field of results.json, search.json and profile.json that `kvsim report` writes into
    a .gp or .dat file, holding backquoted commands: none runs during the report, nor when the
    scripts are run again by hand."""

    def assert_no_marker(self):
        for folder, _, files in os.walk(self.dir):
            self.assertNotIn(MARKER, files, "an injected command ran in " + folder)

    @NEEDS_GNUPLOT
    def test_no_field_of_any_input_runs_as_a_command(self):
        folder = self.path("results")
        os.makedirs(folder)
        base = {"params": {}, "retained_mass": 0.5, "heavy_hitter_recall": 0.5, "output_rel_error": 0.2,
                "output_cosine": 0.9, "compression_ratio": 2.0}
        records = [
            dict(base, policy=hostile("policy"), label=hostile("label"), budget=64, budget_label=hostile("budget_label"),
                 bytes_per_token=10.0),
            dict(base, policy=hostile("policy-alone"), budget=32, budget_label="", budget_profile=hostile("profile"),
                 bytes_per_token=12.0),
        ]
        search = {"format": "kvsim-search", "version": 1, "trace": hostile("trace"), "objective": hostile("objective"),
                  "records": [{"method": hostile("method"), "fit": hostile("fit"), "target": hostile("target"),
                               "objective": hostile("record objective"), "bytes_per_token": 30.0,
                               "compression_ratio": 2.0, "heldout": 0.2, "fitting": 0.1, "delta_ppl": None}]}
        profile = {"format": "kvsim-profile", "version": 1, "name": hostile("name"),
                   "model": {"name": hostile("model"), "num_layers": 2, "num_query_heads": 2, "num_kv_heads": 1,
                             "head_dim": 8},
                   "policy": {"name": "h2o", "params": {"recent_window": 4}},
                   "method": hostile("method"), "target": hostile("target"),
                   "layer_budgets": [16, 24], "head_budgets": [[16], [24]],
                   "expected": {"bytes_per_token": 20.0, "compression_ratio": 2.0},
                   "heldout": {"objective": hostile("heldout objective"), "value": 0.1,
                               "sequences": [hostile("sequence")]},
                   "source": {"trace": hostile("source trace"), "config": hostile("source config")}}
        for name, content in (("results.json", records), ("search.json", search), ("profile.json", profile)):
            with open(os.path.join(folder, name), "w") as f:
                json.dump(content, f)
        result = kvsim("report", folder, cwd=self.dir)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assert_no_marker()
        plots = os.path.join(folder, "plots")
        scripts = sorted(n for n in os.listdir(plots) if n.endswith(".gp"))
        self.assertGreaterEqual(len(scripts), 6, scripts)
        for script in scripts:  # the README's way to redraw a figure
            ran = subprocess.run(["gnuplot", script], cwd=plots, capture_output=True, text=True)
            self.assertEqual(ran.returncode, 0, script + ": " + ran.stderr)
            self.assert_no_marker()
        # The text is there, as text: the series' titles in the figure.
        svg = read(os.path.join(plots, "results-retained_mass.svg"))
        self.assertIn("label `touch pwned` $(touch pwned)", svg)
        self.assertIn("held-out", read(os.path.join(plots, "search-heldout.gp")))


# 120,000 nested lists (about 240 kB): past the bound of 64 at byte 65, and deep enough that a
# recursive conversion overflowed the stack before the bound.
DEPTH_BOMB = "[" * 120000 + "]" * 120000
DEPTH_BOMB_IN_OBJECT = '{"format": "kvsim-profile", "version": 1, "name": ' + "[" * 120000 + "]" * 120000 + "}"


class DeepJson(KvsimTestCase):
    """A depth bomb in every JSON file kvsim reads: one error line naming the file, exit 2."""

    def assert_depth_error(self, result, path):
        self.assert_input_error(result, path + ": lists and objects nested deeper than 64 levels")

    def test_every_reader(self):
        bomb = self.write("bomb.json", DEPTH_BOMB)
        in_object = self.write("bomb-in-object.json", DEPTH_BOMB_IN_OBJECT)
        for path in (bomb, in_object):
            with self.subTest(reader="profile in a config", file=path):
                config = self.write("profile.yaml", TINY_SWEEP.split("budgets")[0] +
                                    "policies: [{profile: %s}]\n" % path)
                self.assert_depth_error(kvsim("run", config, "--out", self.path("o")), path)
            with self.subTest(reader="export", file=path):
                self.assert_depth_error(kvsim("export", path, "--format", "ratios", "-o", self.path("r.json")), path)
        qkv = "trace: {synthetic: qkv, name: tiny-256}\nbudgets: [64]\n"
        with self.subTest(reader="bases"):
            config = self.write("bases.yaml", qkv + "policies: [lowrank: {bases: %s}]\n" % bomb)
            self.assert_depth_error(kvsim("run", config, "--out", self.path("o")), bomb)
        with self.subTest(reader="ranks"):
            bases = self.path("bases.json")
            fitted = self.write("fit.yaml", qkv + "policies: [full]\n")
            made = kvsim("trace", "synth", "qkv", "--name", "tiny-256", "-o", self.path("tiny.h5"))
            self.assertEqual(made.returncode, 0, made.stderr)
            made = kvsim("trace", "bases", self.path("tiny.h5"), "-o", bases)
            self.assertEqual(made.returncode, 0, made.stderr)
            config = self.write("ranks.yaml", "trace: %s\nbudgets: [64]\npolicies: [lowrank: {bases: %s, ranks: %s}]\n"
                                % (self.path("tiny.h5"), bases, bomb))
            self.assert_depth_error(kvsim("run", config, "--out", self.path("o")), bomb)
        for name in ("results.json", "search.json", "profile.json"):
            with self.subTest(reader="report " + name):
                folder = self.path("report-" + name)
                os.makedirs(folder)
                shutil.copy(bomb, os.path.join(folder, name))
                self.assert_depth_error(kvsim("report", folder), os.path.join(folder, name))
        with self.subTest(reader="merge"):
            folder = self.path("merge")
            os.makedirs(folder)
            shutil.copy(bomb, os.path.join(folder, "partial-0-of-1.json"))
            self.assert_depth_error(kvsim("merge", folder), os.path.join(folder, "partial-0-of-1.json"))
        with self.subTest(reader="--resume checkpoint"):
            folder = self.path("resume")
            os.makedirs(folder)
            shutil.copy(bomb, os.path.join(folder, "partial-0-of-1.json"))
            config = self.write("tiny.yaml", TINY_SWEEP)
            self.assert_depth_error(kvsim("run", config, "--out", folder, "--resume"),
                                    os.path.join(folder, "partial-0-of-1.json"))
            shutil.copy(bomb, os.path.join(folder, "partial-1-of-2.json"))
            self.assert_depth_error(kvsim("run", config, "--out", folder, "--resume", "--shard", "1/2"),
                                    os.path.join(folder, "partial-1-of-2.json"))
        with self.subTest(reader="a search's --resume checkpoint"):
            folder = self.path("search-resume")
            os.makedirs(folder)
            shutil.copy(bomb, os.path.join(folder, "partial-0-of-2.json"))
            config = self.write("search.yaml", "trace: {path: %s, max_steps: 64}\nsearch:\n  policy: {h2o: {recent_window: 4}}\n"
                                "  split: {heldout: [4]}\n  target: [2x]\n  grid: [8, 16]\n" % TRACE)
            self.assert_depth_error(kvsim("search", config, "--out", folder, "--resume", "--shard", "0/2"),
                                    os.path.join(folder, "partial-0-of-2.json"))
        if os.path.exists(MODEL):
            with self.subTest(reader="generate"):
                result = kvsim("generate", "--model", MODEL, "--profile", in_object, "--prompt", "Once", "-n", "2")
                self.assert_depth_error(result, in_object)


class StandardOutput(KvsimTestCase):
    """Every command's answer goes to standard output: a full disk (/dev/full) or a closed standard
    output is an error, one line on stderr and exit status 2, not success with the answer lost."""

    def commands(self):
        tiny = self.write("tiny.yaml", TINY_SWEEP)
        search = self.write("search.yaml", "trace: {path: %s, max_steps: 64}\nsearch:\n  policy: {h2o: {recent_window: 4}}\n"
                            "  split: {heldout: [4]}\n  target: [2x]\n  grid: [8, 16]\n" % TRACE)
        profile = self.path("search/profile.json")
        made = kvsim("search", search, "--out", self.path("search"), "-q")
        self.assertEqual(made.returncode, 0, made.stderr)
        commands = {
            "run": ["run", tiny, "--out", self.path("o-run"), "-q", "--format", "json"],
            "run table": ["run", tiny, "--out", self.path("o-run2"), "-q"],
            "sweep": ["sweep", tiny, "--budgets", "40,48", "--out", self.path("o-sweep"), "-q", "--format", "csv"],
            "search": ["search", search, "--out", self.path("o-search"), "-q"],
            "merge": None,  # filled below
            "trace info": ["trace", "info", TRACE],
            "trace synth": ["trace", "synth", "qkv", "--name", "tiny-256", "-o", self.path("t.h5")],
            "trace bases": ["trace", "bases", TRACE, "--no-joint", "-o", self.path("bases.json")],
            "policies": ["policies"],
            "export": ["export", profile, "--format", "ratios", "-o", self.path("ratios.json")],
            "report": ["report", self.path("search")] if HAVE_GNUPLOT else None,
            "--help": ["--help"],
            "--version": ["--version"],
        }
        shard = kvsim("sweep", tiny, "--shard", "0/1", "--out", self.path("o-merge"), "-q")
        self.assertEqual(shard.returncode, 0, shard.stderr)
        commands["merge"] = ["merge", self.path("o-merge"), "-q"]
        if os.path.exists(MODEL):
            story = self.write("story.txt", "Once upon a time, there was a little cat. The cat liked to play.")
            text = ["--model", MODEL, "--text", story]
            eval_config = self.write("eval.yaml", "budgets: [8]\npolicies: [sliding_window]\nmetrics: [ppl]\n")
            commands["eval"] = ["eval", eval_config, *text, "--out", self.path("o-eval"), "-q"]
            commands["generate"] = ["generate", "--model", MODEL, "--profile", profile, "--prompt", "Once", "-n", "4"]
            commands["capture"] = ["capture", *text, "-o", self.path("c.h5")]
        return {k: v for k, v in commands.items() if v}

    def test_a_full_disk_is_an_error(self):
        for name, args in self.commands().items():
            with self.subTest(command=name):
                with open("/dev/full", "w") as full:
                    result = subprocess.run([cli_common.KVSIM, *args], stdout=full, stderr=subprocess.PIPE, text=True,
                                            timeout=300)
                self.assertEqual(result.returncode, 2, result.stderr)
                self.assertEqual(len(result.stderr.strip().splitlines()), 1, result.stderr)
                self.assertIn("kvsim: error: standard output: cannot write", result.stderr)

    def test_a_closed_standard_output_is_an_error(self):
        for name, args in self.commands().items():
            with self.subTest(command=name):
                result = subprocess.run(["bash", "-c", 'exec "$@" >&-', "bash", cli_common.KVSIM, *args],
                                        stderr=subprocess.PIPE, text=True, timeout=300)
                self.assertEqual(result.returncode, 2, result.stderr)
                self.assertEqual(result.stderr, "kvsim: error: standard output is closed; give kvsim somewhere to "
                                                "write its answer\n")


SWEEP_A = TINY_SWEEP  # budgets 48 and 64
SWEEP_B = TINY_SWEEP.replace("budgets: [48, 64]", "budgets: [40, 56]")


def budgets_of(folder):
    """The budgets results.csv and results.json hold, to tell which run wrote each."""
    csv = sorted({line.split(",")[3] for line in read(os.path.join(folder, "results.csv")).splitlines()[1:]})
    records = json.loads(read(os.path.join(folder, "results.json")))
    return csv, sorted({str(r["budget"]) for r in records})


class OutputFolders(KvsimTestCase):
    """A folder's files change together, and one kvsim writes a folder at a time."""

    def start_paused(self, *args, pause="30"):
        """Starts kvsim with its commit paused after the first rename; returns once it is there."""
        process = subprocess.Popen([cli_common.KVSIM, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True, env=dict(os.environ, KVSIM_TEST_COMMIT_PAUSE=pause))
        line = process.stderr.readline()
        if "paused between two renames" not in line:
            process.kill()
            process.wait()
            self.fail("kvsim never paused in its commit: " + line + process.stderr.read())
        return process

    def old_results(self, out):
        old = kvsim("run", self.write("b.yaml", SWEEP_B), "--out", out, "-q")
        self.assertEqual(old.returncode, 0, old.stderr)
        self.assertEqual(budgets_of(out), (["40", "56"], ["40", "56"]))

    def assert_clean(self, out):
        self.assertEqual(sorted(os.listdir(out)), ["results.csv", "results.json"])

    def test_sigint_between_two_renames_waits_for_the_last(self):
        out = self.path("out")
        self.old_results(out)
        process = self.start_paused("run", self.write("a.yaml", SWEEP_A), "--out", out, "-q", pause="1")
        process.send_signal(signal.SIGINT)
        self.assertEqual(process.wait(timeout=60), -signal.SIGINT)  # ends as SIGINT ends it, once committed
        process.stderr.close()
        self.assertEqual(budgets_of(out), (["48", "64"], ["48", "64"]))
        # No lock, journal or temporary file; the run's checkpoint stays (it is removed after the commit).
        self.assertEqual(sorted(os.listdir(out)), ["partial-0-of-1.json", "results.csv", "results.json"])

    def test_sigkill_between_two_renames_is_completed_by_the_next_kvsim(self):
        out = self.path("out")
        self.old_results(out)
        process = self.start_paused("run", self.write("a.yaml", SWEEP_A), "--out", out, "-q")
        process.kill()
        process.wait()
        process.stderr.close()
        # Half done: the journal names the rename still to do, and its temporary file stays.
        self.assertIn(".kvsim-commit", os.listdir(out))
        self.assertEqual(budgets_of(out), (["48", "64"], ["40", "56"]))
        # A later run's temporary-file cleanup leaves it; the next writer of the folder completes it.
        shard = kvsim("run", self.path("a.yaml"), "--shard", "0/2", "--out", out, "-q")
        self.assertEqual(shard.returncode, 0, shard.stderr)
        self.assertIn(".kvsim-commit", os.listdir(out))
        merge_dir = self.path("elsewhere")
        merged = kvsim("merge", os.path.join(out, "partial-0-of-2.json"), "--out", merge_dir, "-q")
        self.assertEqual(merged.returncode, 2)  # not every shard: refused, and the folder is not its output
        report = kvsim("report", out)  # reads the folder: takes it, completes the commit first
        self.assertEqual(budgets_of(out), (["48", "64"], ["48", "64"]))
        self.assertNotIn(".kvsim-commit", os.listdir(out))
        self.assertTrue(report.returncode == 0 or not HAVE_GNUPLOT, report.stderr)

    def test_a_second_writer_is_refused_while_the_first_writes(self):
        out = self.path("out")
        self.old_results(out)
        # Each second writer waits out kvsim's patience (half a second) before it is refused.
        first = self.start_paused("run", self.write("a.yaml", SWEEP_A), "--out", out, "-q", pause="5")
        for args in (["run", self.path("b.yaml"), "--out", out, "-q"],
                     ["sweep", self.path("b.yaml"), "--shard", "0/2", "--out", out, "-q"],
                     ["merge", out, "-q"]):
            with self.subTest(second=args[0]):
                second = kvsim(*args)
                self.assert_input_error(second, out + ": another kvsim is writing into this folder")
        self.assertEqual(first.wait(timeout=60), 0, first.stderr.read())
        first.stderr.close()
        self.assertEqual(budgets_of(out), (["48", "64"], ["48", "64"]))  # the first's, whole
        self.assert_clean(out)

    def test_searches_and_reports_hold_their_folder_too(self):
        out = self.path("search")
        search = self.write("search.yaml", "trace: {path: %s, max_steps: 64}\nsearch:\n  policy: {h2o: {recent_window: 4}}\n"
                            "  split: {heldout: [4]}\n  target: [2x]\n  grid: [8, 16]\n" % TRACE)
        first = self.start_paused("search", search, "--out", out, "-q", pause="3")
        self.assert_input_error(kvsim("search", search, "--out", out, "-q"), "another kvsim is writing")
        self.assert_input_error(kvsim("report", out), "another kvsim is writing")
        self.assertEqual(first.wait(timeout=60), 0)
        first.stderr.close()
        self.assertNotIn(".kvsim-lock", os.listdir(out))
        self.assertNotIn(".kvsim-commit", os.listdir(out))

    def test_shards_share_their_folder(self):
        out = self.path("out")
        config = self.write("a.yaml", SWEEP_A)
        shards = [subprocess.Popen([cli_common.KVSIM, "sweep", config, "--shard", "%d/3" % i, "--out", out, "-q"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(3)]
        for process in shards:
            self.assertEqual(process.wait(timeout=60), 0, process.stderr.read())
            process.stderr.close()
        merged = kvsim("merge", out, "-q")
        self.assertEqual(merged.returncode, 0, merged.stderr)
        self.assertEqual(budgets_of(out), (["48", "64"], ["48", "64"]))

    def test_a_shard_starting_as_another_leaves_is_not_refused(self):
        # A shard that ends takes the folder's lock alone for a moment, to see whether it is the
        # last holder; a shard or merge starting then must wait for that moment, not take it for
        # another writer (a Slurm array's shards start and end at any time).
        out = self.path("out")
        config = self.write("a.yaml", SWEEP_A)
        first = subprocess.Popen([cli_common.KVSIM, "sweep", config, "--shard", "0/2", "--out", out, "-q"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                 env=dict(os.environ, KVSIM_TEST_UNLOCK_PAUSE="0.25"))
        line = first.stderr.readline()
        self.assertIn("paused holding", line)
        second = kvsim("sweep", config, "--shard", "1/2", "--out", out, "-q")
        self.assertEqual(second.returncode, 0, second.stderr)
        self.assertEqual(first.wait(timeout=60), 0, first.stderr.read())
        first.stderr.close()
        merged = kvsim("merge", out, "-q")
        self.assertEqual(merged.returncode, 0, merged.stderr)
        self.assertEqual(budgets_of(out), (["48", "64"], ["48", "64"]))
        self.assertFalse(os.path.exists(os.path.join(out, ".kvsim-lock")))  # the last holder took it away


def edit_json(path, change):
    with open(path) as f:
        data = json.load(f)
    change(data)
    with open(path, "w") as f:
        json.dump(data, f)


class ImpossiblePartials(KvsimTestCase):
    """merge and --resume check every number of a partial against what its frame implies, and its
    identity: one line naming the file and the field, exit 2, nothing merged."""

    def shards(self, config_text=TINY_SWEEP):
        out = self.path("shards")
        config = self.write("c.yaml", config_text)
        for i in range(2):
            made = kvsim("sweep", config, "--shard", "%d/2" % i, "--out", out, "-q")
            self.assertEqual(made.returncode, 0, made.stderr)
        return out, [os.path.join(out, "partial-%d-of-2.json" % i) for i in range(2)]

    def test_numbers_the_frame_rules_out(self):
        def stream(field, value, unit=0, k=0):
            def change(p):
                p["results"][unit]["streams"][k][field] = value
            return change
        # Stream fields: 0 retained_mass, 1 steps, 2 hits, 3 possible, 4 eviction_calls, 5 output
        # error, 6 cosine, 7 output steps, 8 cache bytes, 9 fp16 bytes, 10 context tokens.
        cases = [
            ("zero steps", stream(1, 0), "results[0].streams[0][1] (steps): 0 is outside [1, 4095]"),
            ("negative steps", stream(1, -64), "(steps): -64 is outside [1, 4095]"),
            ("steps past the sequence", stream(1, 5000), "(steps): 5000 is outside [1, 4095]"),
            ("steps of one stream", stream(1, 63), "(steps) has 63 for the same sequence"),
            ("retained mass past the steps", stream(0, 65.0), "(retained_mass): 65.0 is outside [0, 64.000064]"),
            ("retained mass -1e308", stream(0, -1e308), "(retained_mass): -1e+308 is outside"),
            ("a string for a number", stream(1, "64"), "(steps): expected a whole number, got \"64\""),
            ("hits past the possible", stream(2, 10 ** 6), "(heavy_hitter_hits): 1000000 is outside"),
            ("eviction calls past the steps", stream(4, 65), "(eviction_calls): 65 is outside [0, 64]"),
            ("output steps past the steps", stream(7, 65), "(output_steps): 65 is outside [0, 64]"),
            ("negative bytes", stream(8, -1.0), "(cache_bytes): -1.0 is outside [0, 1e+300]"),
            ("a stream short", lambda p: p["results"][0]["streams"][0].pop(), "expected the 12 numbers of a stream"),
            ("a unit twice", lambda p: p["results"].__setitem__(1, p["results"][0]), "results[1].unit: 0 is listed twice"),
            ("a unit of another shard", lambda p: p["results"][0].update(unit=7), ".unit: 7 is outside the shard's units"),
            ("bytes per slot", lambda p: p["results"][0].update(policy_bytes_per_slot=-1), "policy_bytes_per_slot: -1"),
            ("units", lambda p: p.update(units=9), "units: 9, but the rest of the file implies 4"),
            ("shard range", lambda p: p.update(first_unit=1), "first_unit: units [1, 2), but shard 0/2"),
            ("config hash", lambda p: p.update(config_sha256="x"), "config_sha256: expected 64 lowercase hexadecimal"),
            ("a cell's label", lambda p: p["frame"]["cells"][0].update(label="h2o"), "frame: does not match frame_sha256"),
            ("a cell's budget", lambda p: p["frame"]["cells"][1].update(budget=4096), "frame: does not match frame_sha256"),
            ("complete, units missing", lambda p: p["results"].pop(), "complete: true, but 1 of the shard's 2 units"),
        ]
        for name, change, fragment in cases:
            with self.subTest(case=name):
                out, paths = self.shards()
                edit_json(paths[0], change)
                merged = kvsim("merge", out, "--out", self.path("merged"))
                self.assert_input_error(merged, paths[0] + ": not a valid kvsim partial results file: ", fragment)
                self.assertFalse(os.path.exists(self.path("merged")))
                shutil.rmtree(out)

    def test_consistent_edits_of_every_partial_are_refused(self):
        # The frame edited alike in both files (labels, budgets): the frame no longer hashes to
        # frame_sha256.
        out, paths = self.shards()
        for path in paths:
            edit_json(path, lambda p: p["frame"]["cells"][0].update(label="h2o", budget=50, budget_label="50"))
        self.assert_input_error(kvsim("merge", out), paths[0], "frame: does not match frame_sha256")
        shutil.rmtree(out)
        # Every stream of one shard replaying other steps than the other shard's.
        out, paths = self.shards()

        def halve(p):
            for r in p["results"]:
                for stream in r["streams"]:
                    stream[1] = 32
                    stream[0] = min(stream[0], 32)
                    stream[4] = min(stream[4], 32)
                    stream[3] = min(stream[3], 32 * 4096)
                    stream[2] = min(stream[2], stream[3])
        edit_json(paths[1], halve)
        self.assert_input_error(kvsim("merge", out), paths[1] + ": the streams of sequence 0 replay 32 steps, and " +
                                paths[0] + "'s replay 64")

    def test_a_tampered_checkpoint_is_refused_by_resume(self):
        out = self.path("out")
        config = self.write("c.yaml", TINY_SWEEP)
        made = kvsim("sweep", config, "--shard", "0/2", "--out", out, "-q")
        self.assertEqual(made.returncode, 0, made.stderr)
        checkpoint = os.path.join(out, "partial-0-of-2.json")
        for field, value, fragment in ((0, 1e308, "(retained_mass): 1e+308 is outside"),
                                       (1, -1, "(steps): -1 is outside")):
            with self.subTest(field=field):
                edit_json(checkpoint, lambda p: p["results"][1]["streams"][0].__setitem__(field, value))
                resumed = kvsim("sweep", config, "--shard", "0/2", "--out", out, "--resume", "-q")
                self.assert_input_error(resumed, checkpoint + ": not a valid kvsim partial results file: results[1]",
                                        fragment)
                os.remove(checkpoint)
                self.assertEqual(kvsim("sweep", config, "--shard", "0/2", "--out", out, "-q").returncode, 0)

    def test_a_search_partial_edited_to_another_grid_is_refused(self):
        out = self.path("out")
        config = self.write("search.yaml", "trace: {path: %s, max_steps: 64}\nsearch:\n  policy: {h2o: {recent_window: 4}}\n"
                            "  split: {heldout: [4]}\n  target: [2x]\n  grid: [8, 16]\n" % TRACE)
        for i in range(2):
            made = kvsim("search", config, "--shard", "%d/2" % i, "--out", out, "-q")
            self.assertEqual(made.returncode, 0, made.stderr)
        second = os.path.join(out, "partial-1-of-2.json")

        def other_grid(p):
            p["grid"] = [8, 17]
            for r in p["results"]:
                if r["budget"] == 16:
                    r["budget"] = 17
        edit_json(second, other_grid)
        self.assert_input_error(kvsim("merge", out, "-q"), second + " was edited", "config_sha256")
        edit_json(second, lambda p: p["results"][0]["streams"][0].__setitem__(0, 1e9))
        self.assert_input_error(kvsim("merge", out, "-q"), second + ": not a valid kvsim search partial file: "
                                "results[0].streams[0][0] (retained_mass): 1000000000.0 is outside [0, 128.000128]")


class BasesAndRanks(KvsimTestCase):
    """Bases and ranks files are read strictly: values the cache cannot compute with, labels that
    disagree with an entry's place, integers past their range, another version, a ranks file beside
    the ranks it replaces, and the fitting flags that would be ignored."""

    def setUp(self):
        super().setUp()
        self.trace = self.path("tiny.h5")  # 3 layers, 2 KV heads, head size 16
        made = kvsim("trace", "synth", "qkv", "--name", "tiny-256", "-o", self.trace)
        self.assertEqual(made.returncode, 0, made.stderr)
        self.bases = self.path("bases.json")
        made = kvsim("trace", "bases", self.trace, "-o", self.bases)
        self.assertEqual(made.returncode, 0, made.stderr)

    def run_lowrank(self, params):
        config = self.write("c.yaml", "trace: %s\nbudgets: [64]\nmetrics: [output_rel_error]\n"
                                      "policies: [lowrank: {%s}]\n" % (self.trace, params))
        return kvsim("run", config, "--out", self.path("o"))

    def ranks(self, **change):
        ranks = {"format": "kvsim-ranks", "version": 1, "num_layers": 3, "num_kv_heads": 2, "head_dim": 16,
                 "joint": False, "key_rank": [4] * 6, "value_rank": [4] * 6}
        ranks.update(change)
        return self.write("ranks.json", json.dumps(ranks))

    def test_bad_bases_files(self):
        self.assertEqual(self.run_lowrank("bases: %s" % self.bases).returncode, 0)
        original = read(self.bases)

        def zero_vectors(b):
            b["heads"][0]["key"]["vectors"] = [[0.0] * 16 for _ in range(16)]
        cases = [
            ("a value past float", lambda b: b["heads"][0]["key"]["vectors"][0].__setitem__(0, 1e300),
             "heads[0].key.vectors[0][0]: 1e+300 is outside float's range"),
            ("a mean past float", lambda b: b["heads"][1]["value"]["mean"].__setitem__(3, -1e39),
             "heads[1].value.mean[3]: -1e+39 is outside float's range"),
            ("all-zero bases", zero_vectors, "heads[0].key.vectors[0]: has length 0.000000; a basis vector has length 1"),
            ("negative energy", lambda b: b["heads"][0]["key"]["energy"].__setitem__(15, -5.0), "is negative"),
            ("a narrowed integer", lambda b: b.update(num_layers=2 ** 32 + 3), "'num_layers': 4294967299 is outside [1, 4096]"),
            ("a duplicate head", lambda b: b["heads"].__setitem__(1, b["heads"][0]),
             "heads[1].kv_head: 0, but entry 1 is layer 0, KV head 1"),
            ("a layer the trace lacks", lambda b: b["heads"][5].update(layer=99), "heads[5].layer: 99, but entry 5 is layer 2"),
            ("no labels", lambda b: b["heads"][2].pop("layer"), "heads[2].layer: missing"),
            ("another version", lambda b: b.update(version=2), "'version' 2 is not 1"),
            ("no version", lambda b: b.pop("version"), "'version' missing"),
            ("a negative distance", lambda b: b["head_distance"][0][0].__setitem__(1, -1.0), "a distance is at least 0"),
        ]
        for name, change, fragment in cases:
            with self.subTest(case=name):
                with open(self.bases, "w") as f:
                    f.write(original)
                edit_json(self.bases, change)
                self.assert_input_error(self.run_lowrank("bases: %s" % self.bases), self.bases + ": ", fragment)

    def test_hdf5_bases_replay_as_json_bases_do(self):
        h5 = self.path("bases.h5")
        made = kvsim("trace", "bases", self.trace, "-o", h5)
        self.assertEqual(made.returncode, 0, made.stderr)
        with open(h5, "rb") as f:
            data = f.read()
        self.assertEqual(data[:8], b"\x89HDF\r\n\x1a\n")
        self.assertLess(len(data), len(read(self.bases)))
        params = "key_rank: 5, value_rank: 3, bases: %s"
        results = {}
        for name, path in (("json", self.bases), ("hdf5", h5)):
            result = self.run_lowrank(params % path)
            self.assertEqual(result.returncode, 0, result.stderr)
            results[name] = read(self.path("o/results.csv")).replace(os.path.basename(path), "BASES")
        self.assertEqual(results["json"], results["hdf5"])
        self.assertIn("output_rel_error", results["json"])
        # Cut short, or neither form under the HDF5 name: one line, exit 2.
        cut = self.path("cut.h5")
        with open(cut, "wb") as f:
            f.write(data[:len(data) // 2])
        self.assert_input_error(self.run_lowrank(params % cut), cut + ": cannot open as HDF5 (truncated or corrupt)")
        neither = self.write("neither.h5", "{\"format\": \"kvsim-kv-bases\"\n")
        self.assert_input_error(self.run_lowrank(params % neither),
                                neither + ": not an HDF5 file (no HDF5 signature), and not a JSON bases file")

    def test_bad_ranks_files(self):
        self.assertEqual(self.run_lowrank("bases: %s, ranks: %s" % (self.bases, self.ranks())).returncode, 0)
        for name, change, fragment in [
            ("a narrowed rank", {"key_rank": [2 ** 32 + 5] + [4] * 5}, "key_rank[0]: key_rank = 4294967301 must be in 1..16"),
            ("a narrowed shape", {"head_dim": 2 ** 32 + 16}, "'head_dim': 4294967312 is outside [1, 4096]"),
            ("another version", {"version": 3}, "'version' 3 is not 1"),
            ("no version", {"version": None}, "'version': not an integer"),
        ]:
            with self.subTest(case=name):
                ranks = self.ranks(**change)
                self.assert_input_error(self.run_lowrank("bases: %s, ranks: %s" % (self.bases, ranks)), ranks + ": ",
                                        fragment)

    def test_a_ranks_file_beside_the_ranks_it_replaces_is_refused(self):
        ranks = self.ranks()
        for given in ("key_rank: 2", "value_rank: 3"):
            with self.subTest(given=given):
                result = self.run_lowrank("bases: %s, ranks: %s, %s" % (self.bases, ranks, given))
                self.assert_input_error(result, "policies[0].lowrank.%s: ranks (%s) replaces %s, which would go unused"
                                        % (given.split(":")[0], ranks, given.split(":")[0]))
        config = self.write("grid.yaml", "trace: %s\nbudgets: [64]\npolicies: [lowrank: {bases: %s, ranks: %s}]\n"
                                         "grid: {lowrank.key_rank: [2, 4]}\n" % (self.trace, self.bases, ranks))
        self.assert_input_error(kvsim("run", config, "--out", self.path("o")), "grid.lowrank.key_rank",
                                "replaces key_rank")

    def test_fitting_flags_that_would_be_ignored(self):
        out = self.path("b2.json")
        self.assert_input_error(kvsim("trace", "bases", self.trace, "--sequences", "0,0", "-o", out),
                                "--sequences: sequence 0 is listed twice")
        self.assert_input_error(kvsim("trace", "bases", self.trace, "--pre-rope-theta", "0", "-o", out),
                                "--pre-rope-theta: must be a positive number")
        self.assertFalse(os.path.exists(out))


STORIES_SHAPE = {"name": "stories260K", "num_layers": 5, "num_query_heads": 8, "num_kv_heads": 4, "head_dim": 8}


def profile(**fields):
    base = {"format": "kvsim-profile", "version": 1, "name": "p", "model": STORIES_SHAPE,
            "policy": {"name": "h2o", "params": {"recent_window": 8}}, "layer_budgets": [40, 40, 40, 40, 40]}
    base.update(fields)
    return {k: v for k, v in base.items() if v is not None}


SHARES = {"fp16": [[0.3] * 4] * 5, "int8": [[0.3] * 4] * 5, "int4": [[0.2] * 4] * 5}
STREAMING = {"sinks": 4, "recent": 16, "heads": [[0, 1, 0, 0]] * 5, "lambda": [[0.9] * 4] * 5}


class OneProfileValidator(KvsimTestCase):
    """run, eval's config reader, generate (the runtime), export and report take the same profiles
    and refuse the same ones, with the same line naming the file and the key."""

    CASES = [
        ("a window not below the budgets", profile(layer_budgets=[40, 40, 8, 40, 40]),
         "layer_budgets[2]: recent_window = 8 must be less than the budget 8"),
        ("a window not below head budgets", profile(head_budgets=[[40] * 4] * 4 + [[40, 40, 6, 40]]),
         "head_budgets[4][2]: recent_window = 8 must be less than the budget 6"),
        ("tiers and streaming", profile(policy={"name": "stratigraphic", "params": {}}, layer_budgets=None,
                                        tiers=SHARES, streaming=STREAMING),
         "streaming: beside tiers: a profile holds streaming heads or tier shares, not both"),
        ("full with budgets", profile(policy={"name": "full", "params": {}}),
         "layer_budgets: policy full keeps every token: token budgets do not apply"),
        ("int4 with budgets", profile(policy={"name": "int4", "params": {}}), "layer_budgets: policy int4 keeps every token"),
        ("stratigraphic with budgets and no tiers", profile(policy={"name": "stratigraphic", "params": {}}),
         "layer_budgets: policy stratigraphic keeps every token"),
        ("streaming heads for h2o", profile(layer_budgets=None, streaming=STREAMING),
         "streaming: streaming heads are for policy streaming_attention, not h2o"),
        ("an unknown policy", profile(policy={"name": "h3o", "params": {}}), "policy.name: unknown policy 'h3o'"),
        ("an unknown parameter", profile(policy={"name": "h2o", "params": {"window": 8}}),
         "policy: policy.params: unknown parameter 'window'"),
    ]

    def test_every_reader_refuses_the_same_profiles(self):
        have_model = os.path.exists(MODEL)
        for name, content, fragment in self.CASES:
            with self.subTest(case=name):
                path = self.write("profile.json", json.dumps(content))
                expected = path + ": " + fragment
                config = self.write("run.yaml", "trace: %s\npolicies: [{profile: profile.json}]\n" % TRACE)
                self.assert_input_error(kvsim("run", config, "--out", self.path("o")), expected)
                self.assert_input_error(kvsim("export", path, "--format", "ratios", "-o", self.path("r.json")), expected)
                folder = self.path("report")
                os.makedirs(folder, exist_ok=True)
                shutil.copy(path, os.path.join(folder, "profile.json"))
                self.assert_input_error(kvsim("report", folder), os.path.join(folder, "profile.json") + ": " + fragment)
                if have_model:
                    self.assert_input_error(kvsim("generate", "--model", MODEL, "--profile", path, "--prompt", "Once",
                                                  "-n", "40"), expected)
                    story = self.write("story.txt", "Once upon a time, there was a cat.")
                    config = self.write("eval.yaml", "policies: [{profile: profile.json}]\nmetrics: [ppl]\n")
                    self.assert_input_error(kvsim("eval", config, "--model", MODEL, "--text", story, "--out",
                                                  self.path("e")), expected)

    def test_keep_every_token_profiles_without_budgets_are_taken(self):
        path = self.write("profile.json", json.dumps(profile(policy={"name": "int8", "params": {}}, layer_budgets=None)))
        config = self.write("run.yaml", "trace: %s\npolicies: [{profile: profile.json}, {h2o: {recent_window: 8}}]\n"
                                        "budgets: [32]\n" % TRACE)
        result = kvsim("run", config, "--out", self.path("o"), "-q")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("int8", result.stdout)

    @unittest.skipUnless(os.path.exists(MODEL), "../shared/models/stories260K is not present")
    def test_generate_refuses_a_context_past_the_trained_one_as_eval_does(self):
        path = self.write("profile.json", json.dumps(profile()))
        story = self.write("story.txt", "Once upon a time, there was a cat.")
        config = self.write("eval.yaml", "budgets: [16]\npolicies: [sliding_window]\nmetrics: [ppl]\n")
        eval_result = kvsim("eval", config, "--model", MODEL, "--text", story, "--context", "100000", "--out", self.path("e"))
        generated = kvsim("generate", "--model", MODEL, "--profile", path, "--prompt", "Once", "-n", "4",
                          "--context", "100000")
        fragment = MODEL + ": --context 100000 is beyond the model's trained context of 2048 positions"
        self.assert_input_error(eval_result, fragment)
        self.assert_input_error(generated, fragment)


class ClearErrors(KvsimTestCase):
    """The unclear errors of the issue: each one line, exit 2, naming the file and the key."""

    @NEEDS_GNUPLOT
    def test_report_of_values_gnuplot_cannot_place(self):
        folder = self.path("results")
        os.makedirs(folder)
        records = [{"policy": "a", "label": "a", "params": {}, "budget": 64, "retained_mass": 1e308,
                    "bytes_per_token": 10.0},
                   {"policy": "a", "label": "a", "params": {}, "budget": 32, "retained_mass": 0.5,
                    "bytes_per_token": 5.0}]
        with open(os.path.join(folder, "results.json"), "w") as f:
            json.dump(records, f)
        self.assert_input_error(kvsim("report", folder), os.path.join(folder, "results.json") +
                                ": record 0: 'retained_mass' is 1e+308, too large to plot")
        self.assertEqual(os.listdir(folder), ["results.json"])

    def search_config(self, extra, target="[2x]"):
        return self.write("search.yaml", "trace: {path: %s, max_steps: 64}\nsearch:\n  policy: {h2o: {recent_window: 4}}\n"
                                         "  split: {heldout: [4]}\n  target: %s\n  grid: [8, 16]\n%s"
                                         % (TRACE, target, extra))

    def test_a_bad_tiers_value_group_names_the_file_and_key(self):
        config = self.search_config("  fit: [tiers]\n  tiers: {recent: 4, value_group: 3}\n")
        self.assert_input_error(kvsim("search", config, "--out", self.path("o"), "-q"),
                                config + ":8: search.tiers (stratigraphic(", "value_group 3 does not divide the head size 8")

    def test_targets_are_compared_by_value(self):
        self.assert_input_error(kvsim("search", self.search_config("", "[2x, 2.0x]"), "--out", self.path("o"), "-q"),
                                "search.target[1]: target 2.0x is listed twice (as 2x)")
        self.assert_input_error(kvsim("search", self.search_config("", "[{bytes_per_token: 12}, {bytes_per_token: 12.0}]"),
                                      "--out", self.path("o"), "-q"), "target 12B is listed twice (as 12B)")
        distinct = kvsim("search", self.search_config("", "[{bytes_per_token: 12}, {bytes_per_token: 12.0000001}]"),
                         "--out", self.path("o"), "-q")
        self.assertEqual(distinct.returncode, 0, distinct.stderr)
        self.assertIn("12.0000001B", distinct.stdout)
        self.assertTrue(os.path.exists(os.path.join(self.path("o"), "profile-head_budgets-12.0000001B.json")) or
                        os.path.exists(os.path.join(self.path("o"), "profile-layer_budgets-12.0000001B.json")),
                        os.listdir(self.path("o")))

    def test_a_merge_error_names_the_field_without_the_json_library_s_words(self):
        out = self.path("s")
        config = self.write("c.yaml", TINY_SWEEP)
        self.assertEqual(kvsim("sweep", config, "--shard", "0/1", "--out", out, "-q").returncode, 0)
        path = os.path.join(out, "partial-0-of-1.json")
        edit_json(path, lambda p: p["results"][1].update(policy_bytes_per_slot="4"))
        result = kvsim("merge", out)
        self.assert_input_error(result, path + ": not a valid kvsim partial results file: "
                                "results[1].policy_bytes_per_slot: expected a whole number, got \"4\"")
        self.assertNotIn("json.exception", result.stderr)

if __name__ == "__main__":
    cli_common.KVSIM = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
