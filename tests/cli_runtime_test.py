"""kvsim generate, the example engine: stories260K generating text with kvsim's runtime holding its
KV cache under a profile, and the perplexity it reports against kvsim eval's with the same profile.

The runtime shows a policy the attention of its own cache, as eval does with `attention_view:
cached`; the two perplexities then agree within 1e-3 relative. Not to the last digit: the runtime
stores real fp16 where eval keeps the model's fp32 keys and values. (The runtime matches the
simulator bit for bit in tests/unit/test_runtime.cpp, where both see the same numbers.)

Run by meson test as: python3 tests/cli_runtime_test.py build/kvsim
"""
import json
import os
import re
import subprocess
import sys
import unittest

import cli_common
from cli_common import KvsimTestCase, kvsim

SHARED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared")
MODEL = os.path.join(SHARED, "models", "stories260K", "stories260K.gguf")
STORIES = os.path.join(SHARED, "text", "tinystories_sample.txt")
TEXT = ["--text", STORIES, "--split-on", "<|endoftext|>", "--context", "512"]
SHAPE = {"name": "stories260K", "num_layers": 5, "num_query_heads": 8, "num_kv_heads": 4, "head_dim": 8}


def profile(policy, params, **keys):
    return json.dumps(dict({"format": "kvsim-profile", "version": 1, "name": "test-" + policy, "model": SHAPE,
                            "policy": {"name": policy, "params": params}}, **keys))


PROFILES = {
    "h2o": profile("h2o", {"recent_window": 8}, layer_budgets=[40, 40, 60, 60, 90],
                   head_budgets=[[20 + 10 * ((l + kv) % 4) for kv in range(4)] for l in range(5)]),
    "streaming": profile("streaming_attention", {"sinks": 4, "recent": 16},
                         streaming={"sinks": 4, "recent": 16, "heads": [[1, 0, 1, 1]] * 5,
                                    "lambda": [[0.0, 0.5, 0.2, 0.9]] * 5}),
    "tiers": profile("stratigraphic", {"recent": 16},
                     tiers={"fp16": [[0.1] * 4] * 5, "int8": [[0.2, 0.3, 0.4, 0.1]] * 5, "int4": [[0.1] * 4] * 5}),
    # Each head its own method (fit: mixed): in every layer one head evicts, one holds tiers, one
    # streams (with a state in even layers, without one in odd) and one keeps its full cache.
    "mixed": profile("mixed", {}, version=3, mixed={
        "method": [["evict", "tiers", "streaming", "full"]] * 5,
        "evict": {"policy": "h2o", "params": {"recent_window": 8}, "budgets": [[30 + 10 * l, 0, 0, 0] for l in range(5)]},
        "tiers": {"params": {"recent": 16}, "fp16": [[0, 0.1, 0, 0]] * 5, "int8": [[0, 0.3, 0, 0]] * 5,
                  "int4": [[0, 0.1, 0, 0]] * 5},
        "streaming": {"sinks": 4, "recent": 16, "lambda": [[0, 0, 0.5, 0]] * 5,
                      "stateless": [[0, 0, l % 2, 0] for l in range(5)]}}),
}


@unittest.skipUnless(os.path.exists(MODEL), "../shared/models/stories260K is not present")
class Generate(KvsimTestCase):

    def eval_ppl(self, path):
        config = self.write("eval.yaml", "policies: [{profile: %s}]\nmetrics: [ppl]\nattention_view: cached\n" % path)
        result = kvsim("eval", config, "--model", MODEL, *TEXT, "-q", "--out", self.path("eval"))
        self.assertEqual(result.returncode, 0, result.stderr)
        rows = json.load(open(os.path.join(self.path("eval"), "results.json")))
        return [r["ppl"] for r in rows if r["policy"] != "full"][0]

    def test_generates_text_and_matches_eval_perplexity(self):
        for name, text in PROFILES.items():
            with self.subTest(profile=name):
                path = self.write(name + ".json", text)
                result = kvsim("generate", "--model", MODEL, "--profile", path, "--prompt", "Once upon a time",
                               "-n", "200", *TEXT)
                self.assertEqual(result.returncode, 0, result.stderr)
                self.assertTrue(result.stdout.startswith("Once upon a time"), result.stdout)
                self.assertGreater(len(result.stdout.splitlines()[0]), len("Once upon a time") + 40)
                held = re.search(r"held ([0-9.e+]+) bytes per token per \(layer, KV head\), ([0-9.]+)x compression",
                                 result.stdout)
                self.assertIsNotNone(held, result.stdout)
                self.assertGreater(float(held.group(2)), 1.0)  # every profile here holds less than fp16
                ppl = float(re.search(r"with the runtime in the loop: ([0-9.]+) over 1804 predicted tokens",
                                      result.stdout).group(1))
                self.assertAlmostEqual(ppl / self.eval_ppl(path), 1.0, delta=1e-3)

    def test_greedy_generation_is_reproducible_and_thread_independent(self):
        path = self.write("tiers.json", PROFILES["tiers"])
        runs = [kvsim("generate", "--model", MODEL, "--profile", path, "--prompt", "The dog", "-n", "30").stdout
                for _ in range(2)]
        self.assertEqual(runs[0], runs[1])

    def test_bad_input(self):
        other = json.loads(PROFILES["h2o"])
        other["model"] = dict(SHAPE, num_kv_heads=2)
        other["head_budgets"] = [row[:2] for row in other["head_budgets"]]
        path = self.write("other.json", json.dumps(other))
        self.assert_input_error(kvsim("generate", "--model", MODEL, "--profile", path, "--prompt", "Hi"),
                                path + ": the profile was fitted to 5 layers, 8 query heads, 2 KV heads",
                                "the engine's model has 5 layers, 8 query heads, 4 KV heads, head size 8")
        self.assert_input_error(kvsim("generate", "--model", MODEL, "--profile", self.path("none.json"), "--prompt", "Hi"),
                                "none.json")
        # A tier format whose value groups do not cut the engine's head size (8) into whole groups:
        # refused, as kvsim run, search and eval refuse it, not quantised in ragged groups.
        ragged = json.loads(PROFILES["tiers"])
        ragged["policy"]["params"]["value_group"] = 3
        path = self.write("ragged.json", json.dumps(ragged))
        self.assert_input_error(kvsim("generate", "--model", MODEL, "--profile", path, "--prompt", "Hi"),
                                path + ": policy stratigraphic: value_group 3 does not divide the head size 8")
        good = self.write("h2o.json", PROFILES["h2o"])
        self.assert_input_error(kvsim("generate", "--model", MODEL, "--profile", good, "--prompt", "Hi", "--backend",
                                      "cuda"), "backend 'cuda'")
        self.assert_input_error(kvsim("generate", "--model", MODEL, "--profile", good, "--prompt", "Hi", "-n", "600",
                                      "--context", "512"),
                                "pass the model's context of 512 positions")


class SharedLibrary(unittest.TestCase):

    def test_exports_the_c_api_and_nothing_else(self):
        # An engine loads libkvsim_runtime.so beside its own Eigen, yaml-cpp and TBB: any C++
        # symbol it exported could bind to the engine's copy of another version, and kvsim itself
        # links libkvsim as well, where a second exported definition of a class is an ODR violation.
        library = os.path.join(os.path.dirname(cli_common.KVSIM), "runtime", "libkvsim_runtime.so")
        listing = subprocess.run(["nm", "-D", "--defined-only", library], capture_output=True, text=True, check=True)
        exported = {line.split()[-1] for line in listing.stdout.splitlines() if line.strip()}
        header = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "runtime",
                                   "kvsim_runtime.h")).read()
        declared = set(re.findall(r"\b(kvsim_rt_\w+)\(", header))
        self.assertGreaterEqual(len(declared), 9)
        self.assertEqual(exported, declared)


if __name__ == "__main__":
    cli_common.KVSIM = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
