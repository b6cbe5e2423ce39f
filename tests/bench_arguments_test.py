"""The hand-run benchmarks read their command lines as strictly as kvsim does: a bad number or flag
is one line on stderr naming the program and the argument, exit 2, nothing on stdout, no work done.

Run by meson (bench/meson.build) with the benchmarks' paths as arguments."""
import os
import subprocess
import sys
import unittest

PROGRAMS = {}

# (program, arguments, what the one line must say)
CASES = [
    ("bench_replay", ["abc"], "argument 1 (runs) is 'abc'; it must be a whole number from 1 to 1000"),
    ("bench_replay", ["0"], "argument 1 (runs) is '0'"),
    ("bench_plain_policybook", ["3x"], "argument 1 (runs) is '3x'"),
    ("bench_precision", ["-1"], "argument 1 (runs) is '-1'"),
    ("bench_qkv_replay", ["1.5"], "argument 1 (layers) is '1.5'"),
    ("bench_qkv_replay", ["2", "lots"], "argument 2 (block floats) is 'lots'"),
    ("bench_search", ["1024", "16", "0"], "argument 3 (sampled share of steps) is '0'; it must be a number above 0"),
    ("bench_search", ["1024", "16", "1.5"], "argument 3 (sampled share of steps) is '1.5'"),
    ("bench_search", ["1"], "argument 1 (tokens per sequence) is '1'"),
    ("bench_runtime", ["--threads", "0"], "--threads: Value 0 not in range 1 to 1024"),
    ("bench_runtime", ["--no-such-flag"], "--no-such-flag"),
    ("bench_capture", ["--no-such-flag"], "--no-such-flag"),
    ("bench_forward", ["--no-such-flag"], "--no-such-flag"),
]


class BenchArguments(unittest.TestCase):
    def test_bad_arguments_are_one_line_and_exit_2(self):
        for program, args, message in CASES:
            with self.subTest(program=program, args=args):
                path = PROGRAMS[program]
                result = subprocess.run([path, *args], capture_output=True, text=True, timeout=60)
                self.assertEqual(result.returncode, 2, result.stderr)
                self.assertEqual(result.stdout, "")
                lines = result.stderr.splitlines()
                self.assertEqual(len(lines), 1, result.stderr)
                self.assertTrue(lines[0].startswith(path + ": "), lines[0])
                self.assertIn(message, lines[0])

    def test_help_exits_0(self):
        result = subprocess.run([PROGRAMS["bench_runtime"], "--help"], capture_output=True, text=True, timeout=60)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("--context", result.stdout)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        PROGRAMS[os.path.basename(path)] = path
    unittest.main(argv=sys.argv[:1])
