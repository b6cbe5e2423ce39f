"""A sweep beyond one process: shards merged into exactly the files one process writes, bad
partials refused, a killed run resumed, and the Slurm script run task by task as Slurm would.

Run by meson test as: python3 tests/cli_shards_test.py build/kvsim
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

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
TRACE = os.path.join(ROOT, "data", "tinystories-stories260K.h5")
POLICYBOOK = "configs/policybook.yaml"  # the synthetic decode-4096 trace, one layer
QUICKSTART = "configs/quickstart.yaml"  # the policybook's policies on the shipped stories260K trace


class Shards(KvsimTestCase):
    def one_machine(self, config, *flags):
        out = self.path("whole")
        result = kvsim("sweep", config, "--out", out, *flags, cwd=ROOT)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertFalse(os.path.exists(os.path.join(out, "partial-0-of-1.json")), "the checkpoint stayed")
        return result.stdout, read(os.path.join(out, "results.csv")), read(os.path.join(out, "results.json"))

    def sharded(self, config, n, *flags, own_folders=False, order=None):
        """Runs the n shards as separate processes (each into its own folder if own_folders), then merge."""
        folders = []
        for i in (order or range(n)):
            out = self.path("shards%d" % n + ("-%d" % i if own_folders else ""))
            result = kvsim("sweep", config, "--shard", "%d/%d" % (i, n), "--out", out, "-q", *flags, cwd=ROOT)
            self.assertEqual(result.returncode, 0, result.stderr)
            self.assertEqual(result.stdout, "")
            self.assertTrue(os.path.exists(os.path.join(out, "partial-%d-of-%d.json" % (i, n))))
            if out not in folders:
                folders.append(out)
        merged = kvsim("merge", *folders, "--out", self.path("merged%d" % n), cwd=ROOT)
        self.assertEqual(merged.returncode, 0, merged.stderr)
        out = self.path("merged%d" % n)
        return merged.stdout, read(os.path.join(out, "results.csv")), read(os.path.join(out, "results.json"))

    def test_policybook_in_1_2_3_and_7_shards_merges_to_the_one_machine_files_byte_for_byte(self):
        whole = self.one_machine(POLICYBOOK)
        for n in (1, 2, 3, 7):
            with self.subTest(shards=n):
                self.assertEqual(self.sharded(POLICYBOOK, n), whole)

    def test_shipped_trace_in_1_2_3_and_7_shards_merges_to_the_one_machine_files_byte_for_byte(self):
        whole = self.one_machine(QUICKSTART)
        self.assertEqual(len(json.loads(whole[2])), 28)
        for n in (1, 2, 3, 7):
            with self.subTest(shards=n):
                # 7 shards each into its own folder, run out of order: merge takes the folders.
                got = self.sharded(QUICKSTART, n, own_folders=n == 7, order=[6, 2, 0, 5, 1, 4, 3] if n == 7 else None)
                self.assertEqual(got, whole)

    def test_per_layer_per_sequence_and_value_metrics_merge_byte_for_byte(self):
        config = self.write("c.yaml", "trace: {path: %s, max_steps: 64}\nbudgets: [16, 2x]\n"
                                      "policies: [int4, {h2o: {recent_window: 8}}, {evict: tova, adakv: {floor: 0.5}}]\n"
                                      "metrics: [output_rel_error, compression_ratio, retained_mass]\n"
                                      "output: {per_layer: true, per_sequence: true}\n" % TRACE)
        whole = self.one_machine(config, "--set", "h2o.recent_window=4,8")
        self.assertEqual(self.sharded(config, 4, "--set", "h2o.recent_window=4,8"), whole)


class BadInput(KvsimTestCase):
    def shard(self, config, spec, out, *flags):
        return kvsim("sweep", config, "--shard", spec, "--out", out, "-q", *flags, cwd=ROOT)

    def assert_merge_refused(self, folders, *fragments):
        out = self.path("merged")
        result = kvsim("merge", *folders, "--out", out, cwd=ROOT)
        self.assert_input_error(result, *fragments)
        self.assertFalse(os.path.exists(os.path.join(out, "results.csv")))
        self.assertFalse(os.path.exists(os.path.join(out, "results.json")))

    def test_a_shard_index_out_of_range_or_malformed_is_one_line(self):
        for spec, fragment in (("4/4", "out of range (0 to 3)"), ("-1/4", "out of range"), ("0/0", "count"),
                               ("1", "INDEX/COUNT"), ("a/b", "INDEX/COUNT"), ("1/2/3", "INDEX/COUNT")):
            with self.subTest(spec=spec):
                out = self.path("o")
                self.assert_input_error(self.shard(POLICYBOOK, spec, out), "--shard", fragment)
                self.assertFalse(os.path.exists(out))

    def test_partials_of_different_configs_are_refused_naming_the_file(self):
        a, b = self.path("a"), self.path("b")
        self.assertEqual(self.shard(POLICYBOOK, "0/2", a).returncode, 0)
        self.assertEqual(self.shard(POLICYBOOK, "1/2", b, "--budgets", "64,128,256").returncode, 0)
        self.assert_merge_refused([a, b], "partial-1-of-2.json", "config_sha256", "different runs")

    def test_partials_of_different_traces_are_refused_naming_the_file(self):
        folders = []
        for name, trace in (("a", TRACE), ("b", None)):
            folder = self.path(name)
            os.makedirs(folder)
            if trace:
                with open(trace, "rb") as src, open(os.path.join(folder, "t.h5"), "wb") as dst:
                    dst.write(src.read())
            else:
                made = kvsim("trace", "synth", "qkv", "--name", "tiny-256", "-o", os.path.join(folder, "t.h5"))
                self.assertEqual(made.returncode, 0, made.stderr)
            with open(os.path.join(folder, "c.yaml"), "w") as f:
                f.write("trace: {path: t.h5, max_steps: 16}\nbudgets: [8]\npolicies: [sliding_window]\n")
            folders.append(folder)
        self.assertEqual(self.shard(os.path.join(folders[0], "c.yaml"), "0/2", folders[0]).returncode, 0)
        self.assertEqual(self.shard(os.path.join(folders[1], "c.yaml"), "1/2", folders[1]).returncode, 0)
        self.assert_merge_refused(folders, "trace_sha256", "different runs")

    def test_a_missing_shard_or_unfinished_cells_are_refused_naming_the_shards_to_rerun(self):
        out = self.path("s")
        for i in (0, 2):
            self.assertEqual(self.shard(POLICYBOOK, "%d/3" % i, out).returncode, 0)
        self.assert_merge_refused([out], "7 of 21 units", "missing", "--shard 1/3 (no partial-1-of-3.json)")
        # Shard 1 present but one unit short, as a run killed mid-way leaves it.
        self.assertEqual(self.shard(POLICYBOOK, "1/3", out).returncode, 0)
        path = os.path.join(out, "partial-2-of-3.json")
        partial = json.loads(read(path))
        partial["results"].pop()
        partial["complete"] = False
        with open(path, "w") as f:
            json.dump(partial, f)
        self.assert_merge_refused([out], "1 of 21 units", "--shard 2/3 (1 of 7 units unfinished)")

    def test_a_shard_given_twice_or_a_folder_without_partials_or_a_broken_file_is_refused(self):
        a, b = self.path("a"), self.path("b")
        self.assertEqual(self.shard(POLICYBOOK, "0/2", a).returncode, 0)
        self.assertEqual(self.shard(POLICYBOOK, "0/2", b).returncode, 0)
        self.assert_merge_refused([a, b], "shard 0/2 also in")
        empty = self.path("empty")
        os.makedirs(empty)
        self.assert_merge_refused([empty], "no partial results")
        with open(os.path.join(b, "partial-0-of-2.json"), "w") as f:
            f.write('{"kvsim_partial_results": 3, "kvsim_version": "x"}')
        self.assert_merge_refused([b], "partial-0-of-2.json", "not a valid kvsim partial results file",
                                  "config_sha256")

    def test_resume_refuses_a_checkpoint_of_another_config(self):
        out = self.path("s")
        self.assertEqual(self.shard(POLICYBOOK, "0/2", out).returncode, 0)
        result = self.shard(POLICYBOOK, "0/2", out, "--resume", "--budgets", "64")
        self.assert_input_error(result, "partial-0-of-2.json", "another config", "without --resume")


class Resume(KvsimTestCase):
    def test_a_sweep_killed_midway_resumes_to_the_uninterrupted_results(self):
        # Five layers of the shipped trace, checkpointed layer by layer; one thread, so that it is
        # still running when the first checkpoint appears.
        config = self.write("c.yaml", "trace: %s\nbudgets: [12, 16, 24, 32, 48, 64, 96, 128]\n"
                                      "policies: [sliding_window, {h2o: {recent_window: 8}}, tova, "
                                      "{snapkv: {recent_window: 8}}, {pyramidkv: {recent_window: 8}}]\n"
                                      "output: {per_layer: true}\n" % TRACE)
        whole = self.path("whole")
        self.assertEqual(kvsim("run", config, "--out", whole, "-q", "--threads", "1").returncode, 0)
        out = self.path("killed")
        checkpoint = os.path.join(out, "partial-0-of-1.json")
        for sig in (signal.SIGKILL, signal.SIGINT):
            with self.subTest(signal=sig):
                proc = subprocess.Popen([cli_common.KVSIM, "run", config, "--out", out, "-q", "--threads", "1"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                deadline = time.time() + 120
                while not os.path.exists(checkpoint) and proc.poll() is None and time.time() < deadline:
                    time.sleep(0.005)
                proc.send_signal(sig)
                proc.wait()
                self.assertNotEqual(proc.returncode, 0, "the run ended before it could be killed")
                partial = json.loads(read(checkpoint))
                self.assertFalse(partial["complete"])
                done = len(partial["results"])
                self.assertTrue(0 < done < partial["units"], done)
                self.assertFalse(os.path.exists(os.path.join(out, "results.csv")))
                resumed = kvsim("run", config, "--out", out, "--resume", "--threads", "1")
                self.assertEqual(resumed.returncode, 0, resumed.stderr)
                self.assertIn("resumed: %d of %d work units were done, %d replayed now" %
                              (done, partial["units"], partial["units"] - done), resumed.stderr)
                for name in ("results.csv", "results.json"):
                    self.assertEqual(read(os.path.join(out, name)), read(os.path.join(whole, name)), name)
                self.assertEqual(sorted(os.listdir(out)), ["results.csv", "results.json"])  # nothing left over
                os.remove(os.path.join(out, "results.csv"))
                os.remove(os.path.join(out, "results.json"))

    def test_resume_of_a_finished_shard_replays_nothing(self):
        out = self.path("s")
        self.assertEqual(kvsim("sweep", POLICYBOOK, "--shard", "1/3", "--out", out, "-q", cwd=ROOT).returncode, 0)
        before = read(os.path.join(out, "partial-1-of-3.json"))
        again = kvsim("sweep", POLICYBOOK, "--shard", "1/3", "--out", out, "--resume", cwd=ROOT)
        self.assertEqual(again.returncode, 0, again.stderr)
        self.assertIn("resumed: 7 of 7 work units were done, 0 replayed now", again.stderr)
        self.assertEqual(read(os.path.join(out, "partial-1-of-3.json")), before)


class SlurmScript(KvsimTestCase):
    """The emitted script, run as Slurm runs it: submitted by a stand-in sbatch that records what it
    was asked, then each array task with the variables Slurm sets, then the merge job."""

    def test_the_emitted_job_array_and_merge_give_the_one_machine_results(self):
        out = self.path("results")
        script = self.path("sweep.sbatch")
        emitted = kvsim("sweep", QUICKSTART, "--set", "h2o.recent_window=4,8", "--out", out, "--emit-slurm", script,
                        "--shards", "3", "--max-running", "2", cwd=ROOT)
        self.assertEqual(emitted.returncode, 0, emitted.stderr)
        self.assertIn("3 shards", emitted.stdout)
        text = read(script)
        self.assertIn("#SBATCH --array=0-2%2\n", text)
        self.assertIn("SLURM_ARRAY_TASK_ID", text)
        self.assertFalse(os.path.exists(out))  # nothing ran

        # Submission: the array, then the merge after it (afterok on the array's job id).
        bin_dir = self.path("bin")
        os.makedirs(bin_dir)
        log = self.path("sbatch.log")
        with open(os.path.join(bin_dir, "sbatch"), "w") as f:
            f.write("#!/bin/sh\necho \"$@\" >> %s\nn=$(wc -l < %s)\necho $((1000 + n))\n" % (log, log))
        os.chmod(os.path.join(bin_dir, "sbatch"), 0o755)
        env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"])
        for key in list(env):
            if key.startswith("SLURM_"):
                del env[key]
        submitted = subprocess.run(["bash", script], env=env, capture_output=True, text=True, cwd=self.dir)
        self.assertEqual(submitted.returncode, 0, submitted.stderr)
        calls = read(log).splitlines()
        self.assertEqual(len(calls), 2, calls)
        self.assertEqual(calls[0], "--parsable " + os.path.realpath(script))
        self.assertIn("--dependency=afterok:1001", calls[1])
        self.assertTrue(calls[1].endswith(os.path.realpath(script) + " merge"), calls[1])
        self.assertIn("array job 1001 (3 shards) and merge job 1002", submitted.stdout)

        # The array's tasks, out of order, from another folder, then the merge job.
        for task in (2, 0, 1):
            task_env = dict(env, SLURM_JOB_ID=str(2000 + task), SLURM_ARRAY_JOB_ID="1001",
                            SLURM_ARRAY_TASK_ID=str(task), SLURM_ARRAY_TASK_COUNT="3", SLURM_ARRAY_TASK_MIN="0",
                            SLURM_ARRAY_TASK_MAX="2", SLURM_SUBMIT_DIR=self.dir)
            ran = subprocess.run(["bash", script], env=task_env, capture_output=True, text=True, cwd=self.dir)
            self.assertEqual(ran.returncode, 0, ran.stderr)
            self.assertTrue(os.path.exists(os.path.join(out, "partial-%d-of-3.json" % task)))
        merge_env = dict(env, SLURM_JOB_ID="1002", SLURM_ARRAY_JOB_ID="1002", SLURM_ARRAY_TASK_ID="0")
        merged = subprocess.run(["bash", script, "merge"], env=merge_env, capture_output=True, text=True, cwd=self.dir)
        self.assertEqual(merged.returncode, 0, merged.stderr)

        whole = self.path("whole")
        one = kvsim("sweep", QUICKSTART, "--set", "h2o.recent_window=4,8", "--out", whole, "-q", cwd=ROOT)
        self.assertEqual(one.returncode, 0, one.stderr)
        self.assertEqual(merged.stdout, one.stdout)
        for name in ("results.csv", "results.json"):
            self.assertEqual(read(os.path.join(out, name)), read(os.path.join(whole, name)), name)

    def test_emit_slurm_needs_a_shard_count_that_fits_and_no_shard_of_its_own(self):
        script = self.path("s.sbatch")
        for flags, fragment in ((["--emit-slurm", script], "--shards N is required"),
                                (["--emit-slurm", script, "--shards", "22"], "more shards than the sweep's 21"),
                                (["--emit-slurm", script, "--shards", "2", "--shard", "0/2"], "drop them"),
                                (["--shards", "2"], "--emit-slurm")):
            with self.subTest(flags=flags):
                self.assert_input_error(kvsim("sweep", POLICYBOOK, *flags, cwd=ROOT), fragment)
                self.assertFalse(os.path.exists(script))


# A small search: 5 grid budgets x 5 layers of the shipped trace, 64 decode steps.
SEARCH = """trace: {path: %s, max_steps: 64}
search:
  policy: {h2o: {recent_window: 8}}
  split: {heldout: [3, 4]}
  target: [2x]
  fit: [layer_budgets, head_budgets]
  grid: [10, 16, 24, 32, 48]
""" % TRACE


class SearchShards(KvsimTestCase):
    """A search's shards measure shares of its grid replay; the merge finishes the search."""

    def search_outputs(self, folder):
        """Every output file but the partials, search.json without its timing line."""
        files = {}
        for name in sorted(os.listdir(folder)):
            if name.startswith("partial-"):
                continue
            text = read(os.path.join(folder, name))
            if name == "search.json":
                text = "".join(line for line in text.splitlines(True) if not line.lstrip().startswith('"seconds"'))
            files[name] = text
        return files

    def whole_search(self, config, name):
        """The search on one machine into folder `name`: its run and its outputs (search_outputs)."""
        whole = self.path(name)
        one = kvsim("search", config, "--out", whole, "-q", cwd=ROOT)
        self.assertEqual(one.returncode, 0, one.stderr)
        return one, self.search_outputs(whole)

    def search_shard(self, config, spec, out, *flags):
        return kvsim("search", config, "--shard", spec, "--out", out, "-q", *flags, cwd=ROOT)

    def assert_merges_to(self, folders, merged_name, one, expected):
        """kvsim merge of the partials in `folders` prints one machine's table and writes its files."""
        merged = kvsim("merge", *folders, "--out", self.path(merged_name), "-q", cwd=ROOT)
        self.assertEqual(merged.returncode, 0, merged.stderr)
        self.assertEqual(merged.stdout, one.stdout)
        self.assertEqual(self.search_outputs(self.path(merged_name)), expected)

    def test_search_in_1_2_and_3_shards_merges_to_the_one_machine_outputs_byte_for_byte(self):
        config = self.write("search.yaml", SEARCH)
        one, expected = self.whole_search(config, "whole")
        self.assertIn("profile.json", expected)
        self.assertIn("fitted head budgets", one.stdout)
        for n in (1, 2, 3):
            with self.subTest(shards=n):
                folders = []
                for i in ((2, 0, 1) if n == 3 else range(n)):
                    # 3 shards each into its own folder, out of order: the merge takes the folders.
                    out = self.path("s%d" % n + ("-%d" % i if n == 3 else ""))
                    ran = self.search_shard(config, "%d/%d" % (i, n), out)
                    self.assertEqual(ran.returncode, 0, ran.stderr)
                    self.assertEqual(ran.stdout, "")
                    partial = json.loads(read(os.path.join(out, "partial-%d-of-%d.json" % (i, n))))
                    self.assertEqual(partial["units"], 25)
                    self.assertTrue(partial["complete"])
                    if out not in folders:
                        folders.append(out)
                self.assert_merges_to(folders, "merged%d" % n, one, expected)

        # A shard cut short after its first layer (complete: false) resumes the rest.
        out = self.path("s2")
        path = os.path.join(out, "partial-1-of-2.json")
        partial = json.loads(read(path))
        first_layer = partial["results"][0]["layer"]
        partial["results"] = [r for r in partial["results"] if r["layer"] == first_layer]
        partial["complete"] = False
        with open(path, "w") as f:
            json.dump(partial, f)
        resumed = kvsim("search", config, "--shard", "1/2", "--out", out, "--resume", cwd=ROOT)
        self.assertEqual(resumed.returncode, 0, resumed.stderr)
        self.assertIn("resumed: %d of 13 work units were done" % len(partial["results"]), resumed.stderr)
        merged = kvsim("merge", out, "--out", self.path("resumed"), "-q", cwd=ROOT)
        self.assertEqual(merged.returncode, 0, merged.stderr)
        self.assertEqual(self.search_outputs(self.path("resumed")), expected)

    def test_a_mixed_search_in_2_shards_merges_to_the_one_machine_outputs(self):
        # The shards divide the grid replay; the merge fits the rest (tiers, then the mix across
        # eviction and tiers per head) as one machine does, byte for byte: also with the output
        # error sampled, whose estimates and intervals the partials carry.
        mixed = SEARCH.replace("fit: [layer_budgets, head_budgets]", "fit: [head_budgets, tiers, mixed]\n  tiers: {sinks: 2, recent: 8}")
        for name, text in (("every-step", mixed), ("sampled", mixed + "  sample: {steps: 0.3, seed: 5}\n")):
            with self.subTest(name):
                config = self.write(name + ".yaml", text)
                one, expected = self.whole_search(config, name + "-whole")
                self.assertIn("profile-mixed-2x.json", expected)
                self.assertEqual(name == "sampled", "heldout_interval" in expected["search.json"])
                out = self.path(name + "-shards")
                for i in range(2):
                    ran = self.search_shard(config, "%d/2" % i, out)
                    self.assertEqual(ran.returncode, 0, ran.stderr)
                self.assert_merges_to([out], name + "-merged", one, expected)

    def test_a_screened_tier_search_in_3_shards_merges_to_the_one_machine_outputs(self):
        # search.screen: each shard screens the layers of its tier units on the prefix (16 steps)
        # and replays their options; its partial names each head's options, which the merge reads
        # instead of screening again, and it writes what one machine writes, the mix included.
        screened = SEARCH.replace("fit: [layer_budgets, head_budgets]",
                                  "fit: [head_budgets, tiers, mixed]\n  tiers: {sinks: 2, recent: 8}\n"
                                  "  screen: {steps: 16, keep: 5}")
        config = self.write("screened.yaml", screened)
        one, expected = self.whole_search(config, "whole")
        self.assertIn("replayed 5 per head in full", expected["search.json"])
        self.assertIn("profile-mixed-2x.json", expected)
        out = self.path("shards")
        for i in (1, 2, 0):
            ran = self.search_shard(config, "%d/3" % i, out)
            self.assertEqual(ran.returncode, 0, ran.stderr)
            partial = json.loads(read(os.path.join(out, "partial-%d-of-3.json" % i)))
            self.assertEqual(partial["tier_candidates"], 5)  # each head's options, not the 52 candidates
            self.assertEqual(partial["tier_screened"], 52)
            for r in partial["results"]:
                if r["pass"].startswith("tier"):
                    self.assertEqual(len(r["options"]), 4)  # per KV head: 5 of the 52, ascending
                    for head in r["options"]:
                        self.assertEqual(len(head), 5)
                        self.assertEqual(head, sorted(set(head)))
                        self.assertLess(head[-1], 52)
                else:
                    self.assertNotIn("options", r)
        self.assert_merges_to([out], "merged", one, expected)

        def edit_layer_0_options(edit, first_unit_only=False):
            # Every tier unit of layer 0, in whichever partial holds it (or the first such alone).
            for i in range(3):
                path = os.path.join(out, "partial-%d-of-3.json" % i)
                partial = json.loads(read(path))
                units = [r for r in partial["results"] if "options" in r and r["layer"] == 0]
                for r in units[:1] if first_unit_only else units:
                    r["options"] = edit(r["options"])
                with open(path, "w") as f:
                    json.dump(partial, f)
                if first_unit_only and units:
                    return

        # The merge takes each head's options from the partials: layer 0's heads named as choosing
        # other candidates (each index one along, 51 to 0) change what it fits.
        edit_layer_0_options(lambda heads: [sorted((i + 1) % 52 for i in h) for h in heads])
        moved = kvsim("merge", out, "--out", self.path("moved"), "-q", cwd=ROOT)
        self.assertEqual(moved.returncode, 0, moved.stderr)
        self.assertNotEqual(self.search_outputs(self.path("moved")), expected)

        def other_last_option(head):  # the same options but the last, for one not among them
            free = [c for c in range(52) if c not in head]
            return sorted(head[:-1] + [free[-1] if free[-1] > head[-2] else free[0]])

        for name, edit, fragment in (
                ("differ", lambda heads: [other_last_option(heads[0])] + heads[1:],
                 "tier options (layer 0) differ from"),
                ("unordered", lambda heads: [heads[0][::-1]] + heads[1:], "options must ascend")):
            with self.subTest(name):
                edit_layer_0_options(edit, first_unit_only=True)
                refused = kvsim("merge", out, "--out", self.path("refused"), cwd=ROOT)
                self.assert_input_error(refused, "partial-", fragment)
                self.assertFalse(os.path.exists(self.path("refused")))

    def test_a_coarse_grid_search_in_2_shards_merges_to_the_one_machine_outputs(self):
        # search.coarse_grid: the shards measure the first pass's budgets (every 4th of 8, and the
        # last); the merge refines around each fit's choices as one machine does, byte for byte.
        coarse = SEARCH.replace("grid: [10, 16, 24, 32, 48]", "grid: [10, 12, 16, 20, 24, 32, 40, 48]\n  coarse_grid: 4")
        config = self.write("coarse.yaml", coarse)
        one, expected = self.whole_search(config, "whole")
        self.assertIn("measured every 4th of the 8 grid budgets", expected["search.json"])
        out = self.path("shards")
        for i in (1, 0):
            ran = self.search_shard(config, "%d/2" % i, out)
            self.assertEqual(ran.returncode, 0, ran.stderr)
            partial = json.loads(read(os.path.join(out, "partial-%d-of-2.json" % i)))
            self.assertEqual(partial["grid"], [10, 24, 48])
            self.assertEqual(partial["units"], 3 * 5)  # the first pass's 3 budgets x 5 layers
        self.assert_merges_to([out], "merged", one, expected)

    def test_a_tier_streaming_and_rank_search_in_3_shards_merges_to_the_one_machine_outputs(self):
        # The shards measure the tier fit's two big passes (every plan's bytes on the held-out
        # sequences, every candidate's errors on the fitting ones), the streaming fit's lambda
        # searches, a layer a unit, and the rank fit's pass over its ladders; the merge replays only
        # the baselines and the held-out confirmations, and writes what one machine writes.
        tiers = SEARCH.replace("fit: [layer_budgets, head_budgets]",
                               "fit: [tiers, streaming, ranks]\n  tiers: {sinks: 2, recent: 8}\n"
                               "  streaming: {sinks: 1, recent: 2}\n  sample: {steps: 0.5, seed: 3}")
        config = self.write("tiers.yaml", tiers)
        one, expected = self.whole_search(config, "whole")
        self.assertIn("profile-tiers-2x.json", expected)
        self.assertIn("profile-streaming-2x.json", expected)
        self.assertIn("ranks-heads-2x.json", expected)
        out = self.path("shards")
        passes = set()
        for i in (2, 0, 1):
            ran = self.search_shard(config, "%d/3" % i, out)
            self.assertEqual(ran.returncode, 0, ran.stderr)
            partial = json.loads(read(os.path.join(out, "partial-%d-of-3.json" % i)))
            self.assertEqual(partial["grid"], [])
            self.assertTrue(partial["streaming"])
            self.assertGreater(partial["rank_plans"], 0)
            self.assertEqual(partial["units"],
                             (partial["tier_plans"] + partial["tier_candidates"] + 1 + partial["rank_plans"]) * 5)
            self.assertEqual(partial["heldout_sequences"], ["tinystories_sample-3", "tinystories_sample-4"])
            for r in partial["results"]:
                passes.add(r["pass"])
                if r["pass"] == "streaming":
                    self.assertEqual(len(r["heads"]), partial["num_kv_heads"])
                else:
                    self.assertEqual(len(r["streams"]), (2 if r["pass"] == "tier bytes" else 3) * partial["num_kv_heads"])
        self.assertEqual(passes, {"tier bytes", "tier errors", "streaming", "rank errors"})
        self.assert_merges_to([out], "merged", one, expected)

        # A unit's pass edited: the merge names the field.
        path = os.path.join(out, "partial-1-of-3.json")
        original = read(path)
        partial = json.loads(original)
        partial["results"][0]["pass"] = "grid"
        with open(path, "w") as f:
            json.dump(partial, f)
        self.assert_input_error(kvsim("merge", out, "--out", self.path("bad"), cwd=ROOT), "partial-1-of-3.json",
                                "results[0].pass")
        with open(path, "w") as f:
            f.write(original)
        # A streaming unit's lambda missing (null): the merge names the partial and the field.
        path = os.path.join(out, "partial-2-of-3.json")
        partial = json.loads(read(path))
        streaming = [i for i, r in enumerate(partial["results"]) if r["pass"] == "streaming"][0]
        partial["results"][streaming]["heads"][0][0] = None
        with open(path, "w") as f:
            json.dump(partial, f)
        self.assert_input_error(kvsim("merge", out, "--out", self.path("bad"), cwd=ROOT), "partial-2-of-3.json",
                                "results[%d].heads[0][0]" % streaming)
        self.assertFalse(os.path.exists(self.path("bad")))
        # A target no tier plan reaches is refused by the shard before it replays its units.
        unreachable = self.write("unreachable.yaml", tiers.replace("target: [2x]", "target: [40x]"))
        self.assert_input_error(self.search_shard(unreachable, "0/3", self.path("u")), "40x for fit: tiers",
                                "search.tiers.recent")
        self.assertFalse(os.path.exists(os.path.join(self.path("u"), "partial-0-of-3.json")))
        # So is one no set of streaming heads reaches, by a shard of the streaming fit.
        streaming = self.write("streaming.yaml", tiers.replace("fit: [tiers, streaming, ranks]", "fit: [streaming]")
                               .replace("target: [2x]", "target: [40x]"))
        self.assert_input_error(self.search_shard(streaming, "1/2", self.path("v")), "40x with streaming heads",
                                "search.streaming.recent")
        self.assertFalse(os.path.exists(os.path.join(self.path("v"), "partial-1-of-2.json")))

    def test_bad_search_shards_are_refused_in_one_line(self):
        config = self.write("search.yaml", SEARCH)
        out = self.path("s")
        self.assertEqual(self.search_shard(config, "0/2", out).returncode, 0)
        merged_dir = self.path("merged")
        # A missing shard: the merge names it.
        self.assert_input_error(kvsim("merge", out, "--out", merged_dir, cwd=ROOT),
                                "13 of 25 units (grid budget x layer) missing", "--shard 1/2 (no partial-1-of-2.json)")
        # The config changed after the shards ran: the merge would fit another config's curves.
        self.assertEqual(self.search_shard(config, "1/2", out).returncode, 0)
        with open(config, "a") as f:
            f.write("output: {dir: elsewhere}\n")
        self.assert_input_error(kvsim("merge", out, "--out", merged_dir, cwd=ROOT),
                                "search.yaml: changed since the shards ran", "rerun the shards")
        self.assertFalse(os.path.exists(merged_dir))
        # A search that deploys to kvpress runs on one machine; a sweep's and a search's partials
        # do not merge.
        kvpress = self.write("kvpress.yaml", SEARCH.replace("policy: {h2o: {recent_window: 8}}", "policy: snapkv_press")
                             .replace("fit: [layer_budgets, head_budgets]", "fit: [layer_budgets]\n  deploy: kvpress\n"
                                      "  prompt: {tokens: 16}").replace("  grid: [10, 16, 24, 32, 48]\n", "")
                             .replace("target: [2x]", "target: [1.2x]"))
        self.assert_input_error(self.search_shard(kvpress, "0/2", self.path("t")), "search.deploy", "without --shard")
        sweep = self.path("sweep")
        self.assertEqual(kvsim("sweep", POLICYBOOK, "--shard", "1/2", "--out", sweep, "-q", cwd=ROOT).returncode, 0)
        self.assert_input_error(kvsim("merge", out, sweep, "--out", merged_dir, cwd=ROOT), "partial-1-of-2.json",
                                "not a valid kvsim search partial file")

    def test_emit_slurm_for_a_search_runs_its_shards_and_the_merge(self):
        config = self.write("search.yaml", SEARCH)
        script, out = self.path("search.sbatch"), self.path("results")
        self.assert_input_error(kvsim("search", config, "--emit-slurm", script, "--shards", "26", "--out", out, cwd=ROOT),
                                "more shards than the search's 25 work units (grid budgets x layers)")
        emitted = kvsim("search", config, "--emit-slurm", script, "--shards", "4", "--out", out, cwd=ROOT)
        self.assertEqual(emitted.returncode, 0, emitted.stderr)
        text = read(script)
        self.assertIn("#SBATCH --array=0-3%4\n", text)
        self.assertIn("a search as a Slurm job array", text)
        self.assertIn("'search' ", text)
        self.assertIn("merge", text)


if __name__ == "__main__":
    cli_common.KVSIM = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
