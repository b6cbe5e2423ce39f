"""What the command-line tests share: running kvsim, a temporary folder per test, and the check
that a bad input is one error line, exit status 2, and nothing written.

Each test file sets cli_common.KVSIM from its command line before unittest.main().
"""
import os
import subprocess
import tempfile
import unittest

KVSIM = None


def kvsim(*args, cwd=None, memory=None, timeout=300):
    """Runs kvsim; `memory` is the global --max-memory (it goes before the command). The timeout
    turns a hang (a FIFO opened for reading blocks forever) into a test failure."""
    limit = ["--max-memory", memory] if memory else []
    return subprocess.run([KVSIM, *limit, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout)


def read(path):
    with open(path) as f:
        return f.read()


class KvsimTestCase(unittest.TestCase):
    """A fresh folder per test (self.dir). `outputs` lists the paths a failed run must not leave."""

    outputs = ()

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.dir, name)

    def write(self, name, data, mode="w"):
        path = self.path(name)
        with open(path, mode) as f:
            f.write(data)
        return path

    def assert_input_error(self, result, *fragments):
        """Exit 2 with one line `kvsim: error: ...` holding every fragment, and no output left."""
        self.assertEqual(result.returncode, 2, result.stderr)
        lines = result.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, result.stderr)
        for fragment in fragments:
            self.assertIn(fragment, lines[0])
        for name in self.outputs:
            self.assertFalse(os.path.exists(self.path(name)), name + " was written by a failed run")
