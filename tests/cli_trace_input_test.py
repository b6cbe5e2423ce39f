"""Hostile traces and parameters through the kvsim command line: one error line naming the file
and the dataset or key, exit status 2, nothing written.

Run by meson test as: python3 tests/cli_trace_input_test.py build/kvsim build/tests/make_hostile_trace
The hostile traces are written by make_hostile_trace (kvsim's TraceWriter plus HDF5 edits).
"""
import os
import subprocess
import sys
import unittest

import cli_common
from cli_common import KvsimTestCase, kvsim

MAKE_TRACE = None


class TraceInput(KvsimTestCase):
    outputs = ("out",)

    def setUp(self):
        super().setUp()
        self.out = self.path("out")

    def trace(self, kind):
        path = os.path.join(self.dir, kind + ".h5")
        subprocess.run([MAKE_TRACE, kind, path], check=True)
        return path

    def run_trace(self, kind, policies="[h2o, tova]", budgets="[48]", memory=None):
        path = self.trace(kind)
        config = self.write(kind + ".yaml", "trace: %s.h5\nbudgets: %s\npolicies: %s\n" % (kind, budgets, policies))
        return path, kvsim("run", config, "--out", self.out, memory=memory)

    def test_valid_hostile_starting_points_replay(self):
        for kind in ("valid-qkv", "valid-attention"):
            _, result = self.run_trace(kind)
            self.assertEqual(result.returncode, 0, result.stderr)

    def test_non_finite_q_k_v_name_the_dataset_and_element(self):
        path, result = self.run_trace("qkv-nan")
        self.assert_input_error(result, path + ": dataset '/sequences/000000/qkv/layer_001/k': element 1000",
                                "is nan; Q, K and V must be finite")
        path, result = self.run_trace("qkv-inf")
        self.assert_input_error(result, path + ": dataset '/sequences/000000/qkv/layer_000/q': element 77", "is inf")
        path, result = self.run_trace("qkv-fp16-nan")
        self.assert_input_error(result, path + ": dataset '/sequences/000000/qkv/layer_000/v': element 500")

    def test_a_corrupt_chunk_in_a_layer_loaded_beside_the_replay(self):
        # Layer 1 loads as a task beside layer 0's replay, perhaps on another thread: its error is
        # still kvsim's one line (HDF5's own error stack is silenced on every thread that reads).
        for threads in ("1", "2"):
            path = self.trace("qkv-corrupt-chunk")
            config = self.write("corrupt.yaml", "trace: qkv-corrupt-chunk.h5\nbudgets: [48]\npolicies: [h2o, tova]\n")
            result = kvsim("run", config, "--out", self.out, "--threads", threads)
            self.assert_input_error(result, path + ": cannot read dataset '/sequences/000000/qkv/layer_001/k' "
                                    "(truncated or corrupt)")

    def test_overflowing_logits_name_trace_sequence_layer_head_and_step(self):
        path, result = self.run_trace("qkv-overflow")
        self.assert_input_error(result, path + ": sequence story, layer 1, head 3, step 5: an attention logit",
                                "is not finite")

    def test_attention_weights_outside_a_softmax(self):
        offset = 10 * 9 // 2 + 3
        path, result = self.run_trace("attention-nan")
        self.assert_input_error(result, path + ": dataset '/sequences/000000/attention/layer_000/head_000': element %d "
                                "(step 10, position 3) is nan" % offset)
        _, result = self.run_trace("attention-above-one")
        self.assert_input_error(result, "(step 20, position 7) is 1.5; attention weights must be finite and within [0, 1]")
        _, result = self.run_trace("attention-negative")
        self.assert_input_error(result, "(step 20, position 7) is -0.25")
        _, result = self.run_trace("attention-row-sum")
        self.assert_input_error(result, "the row of step 30 (elements 435..464) sums to 1.5")

    def test_sizes_the_file_does_not_hold(self):
        path, result = self.run_trace("length-2e31")
        self.assert_input_error(result, path + ": /sequences/000000: attribute 'length' = 2147483648 must be <= 1073741824")
        self.assert_input_error(kvsim("trace", "info", path), "attribute 'length' = 2147483648")
        path, result = self.run_trace("attention-unstored")
        self.assert_input_error(result, path + ": dataset '/sequences/000000/attention/layer_000/head_000' [549755289600]",
                                "stores 1 of its 8388600 chunks")
        path, result = self.run_trace("qkv-unstored")
        self.assert_input_error(result, path + ": dataset '/sequences/000000/qkv/layer_000/q' [16777216, 4, 8] (2.0 GiB) "
                                "stores 0 of its 65536 chunks")

    def test_a_chunk_over_the_memory_limit(self):
        path, result = self.run_trace("big-chunk", memory="16M")
        self.assert_input_error(result, path + ": dataset '/sequences/000000/attention/layer_000/head_000' [8386560] "
                                "in chunks of [8386560] needs 32.0 MiB, over the memory limit of 16.0 MiB (--max-memory)")

    def test_counts_past_int_and_string_arrays(self):
        path, result = self.run_trace("num-layers-2e32")
        self.assert_input_error(result, path + ": attribute 'num_layers' = 4294967297 must be <= 2147483647")
        path, result = self.run_trace("string-array")
        self.assert_input_error(result, path + ": attribute 'model_name' is not one string")
        path, result = self.run_trace("external-link")
        self.assert_input_error(result, path + ": '/sequences/000000/qkv/layer_001/k' is a soft or external link")

    def test_policy_parameters_that_size_memory(self):
        base = "trace: {synthetic: policybook, max_steps: 50}\nbudgets: [256]\n"
        config = self.write("obs.yaml", base + "policies:\n  - snapkv: {obs_window: 1000000000}\n")
        self.assert_input_error(kvsim("run", config, "--out", self.out, memory="1G"),
                                "obs.yaml:4: policies[0].snapkv.obs_window = 1000000000 (1000000000 steps of attention "
                                "x 257 cached tokens) needs", "over the memory limit of 1.0 GiB (--max-memory)")
        # The same value from the command line's grid names the flag.
        config = self.write("grid.yaml", base + "policies: [snapkv]\n")
        self.assert_input_error(kvsim("sweep", config, "--set", "snapkv.obs_window=16,1e9", "--out", self.out,
                                      memory="1G"), "--set snapkv.obs_window = 1000000000 (")
        # Per-layer budgets (a profile) size the same window per layer.
        config = self.write("layers.yaml", "trace: {synthetic: qkv, name: tiny-256, max_steps: 40}\nbudgets: [48]\n"
                                           "layer_budgets: [40, 48, 56]\n"
                                           "policies:\n  - pyramidkv: {obs_window: 1000000000}\n")
        self.assert_input_error(kvsim("run", config, "--out", self.out, memory="1G"),
                                "layers.yaml:5: policies[0].pyramidkv.obs_window = 1000000000")
        config = self.write("stream.yaml", "trace: {synthetic: qkv, name: tiny-256, max_steps: 40}\nbudgets: [48]\n"
                                           "policies:\n  - streaming_attention: {recent: 1000000000}\n")
        self.assert_input_error(kvsim("run", config, "--out", self.out, memory="1G"),
                                "stream.yaml:4: policies[0].streaming_attention.recent = 1000000000 (4 sinks + "
                                "1000000000 recent tokens of head size 16")
        config = self.write("sinks.yaml", "trace: {synthetic: qkv, name: tiny-256, max_steps: 40}\nbudgets: [48]\n"
                                          "policies:\n  - streaming_attention: {sinks: 1000000000}\n")
        self.assert_input_error(kvsim("run", config, "--out", self.out, memory="1G"),
                                "sinks.yaml:4: policies[0].streaming_attention.sinks = 1000000000")

    def test_sizes_a_config_makes_huge_but_the_sequence_does_not_need(self):
        # More sinks than the sequence has tokens (the budget is larger still), and a k of 2^30.
        config = self.write("k.yaml", "trace: {synthetic: policybook, max_steps: 100}\nbudgets: [8192]\n"
                                      "policies:\n  - streaming_llm: {sinks: 5000}\n"
                                      "metrics: [retained_mass, {heavy_hitter_recall: {k: 1073741824}}]\n")
        result = kvsim("run", config, "--out", self.out, "-q")
        self.assertEqual(result.returncode, 0, result.stderr)

    def test_a_replay_over_the_memory_limit_names_the_sequence(self):
        config = self.write("plan.yaml", "trace: {synthetic: policybook}\nbudgets: [256]\npolicies: [h2o]\n")
        self.assert_input_error(kvsim("run", config, "--out", self.out, memory="256K"),
                                "sequence decode-4096 (4096 tokens), layer 0: replaying 1 configurations over 1 KV "
                                "heads needs")


if __name__ == "__main__":
    MAKE_TRACE = os.path.abspath(sys.argv.pop(2))
    cli_common.KVSIM = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
