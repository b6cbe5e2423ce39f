#!/usr/bin/env python3
"""No folder includes one above it.

kvsim's folders form a stack, lowest first. A source file may include headers of its own folder
and of any folder below it, never of one above: the arithmetic of a cache never depends on a
policy, a policy never on the replay engine, the libraries never on the program. Run from the
repository root (meson test does); exits 1 naming every include that crosses upward.
"""
import pathlib
import re
import sys
import unittest

# Lowest first. tests/ and bench/ sit above everything and may include anything.
STACK = ["base", "cache_math", "model", "policies", "sim", "search", "runtime", "src"]
SOURCES = (".h", ".cpp", ".cu", ".cuh")
# Headers meson generates into the build root (the version string).
GENERATED = {"kvsim_version.h"}
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def upward_includes(root):
    """(file, included path, why) for every include of a folder above the file's own."""
    found = []
    rank = {folder: i for i, folder in enumerate(STACK)}
    for folder in STACK:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in SOURCES or not path.is_file():
                continue
            for included in INCLUDE.findall(path.read_text(errors="replace")):
                top = included.split("/")[0]
                where = str(path.relative_to(root))
                if "/" not in included:
                    if included in GENERATED or (path.parent / included).is_file():
                        continue
                    found.append((where, included, "not a path from the repository root"))
                elif top not in rank:
                    found.append((where, included, f"'{top}/' is not a library folder"))
                elif rank[top] > rank[folder]:
                    found.append((where, included, f"'{top}/' sits above '{folder}/'"))
    return found


class Layering(unittest.TestCase):
    def test_no_folder_includes_one_above_it(self):
        root = pathlib.Path.cwd()
        self.assertTrue((root / "meson.build").is_file(), "run from the repository root")
        bad = upward_includes(root)
        self.assertEqual([], bad, "\n".join(f"{f}: #include \"{i}\": {why}" for f, i, why in bad))

    def test_the_check_sees_an_upward_include(self):
        # The check itself must fail on a crossing: a policy including the replay engine.
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            root = pathlib.Path(tmp)
            for folder in STACK:
                (root / folder).mkdir()
            (root / "sim" / "harness.h").write_text('#include "policies/policy.h"\n')
            (root / "policies" / "policy.h").write_text('#include "cache_math/tiers.h"\n')
            self.assertEqual([], upward_includes(root))
            (root / "policies" / "h2o.cpp").write_text('#include "sim/harness.h"\n')
            (root / "cache_math" / "tiers.cpp").write_text('#include "model/gguf.h"\n')
            self.assertEqual([("cache_math/tiers.cpp", "model/gguf.h", "'model/' sits above 'cache_math/'"),
                              ("policies/h2o.cpp", "sim/harness.h", "'sim/' sits above 'policies/'")],
                             upward_includes(root))

    def test_every_source_folder_is_in_the_stack(self):
        # A new top-level folder of C++ sources must take a place in the stack, or it escapes the check.
        root = pathlib.Path.cwd()
        outside = {"tests", "bench", "build", "docs", "configs", "data"}
        for folder in root.iterdir():
            if not folder.is_dir() or folder.name.startswith(".") or folder.name in outside:
                continue
            if folder.name.startswith("build"):
                continue
            has_sources = any(p.suffix in SOURCES for p in folder.rglob("*"))
            if has_sources:
                self.assertIn(folder.name, STACK, f"{folder.name}/ holds C++ sources but has no place in STACK")


if __name__ == "__main__":
    unittest.main(verbosity=2)
