#!/usr/bin/env python3
"""By hand: the CPU time (user + sys) of a sweep (or, with --search, a search) split into shards run
as separate processes, plus their merge, against the same command in one process; the merged files
are checked byte for byte (a search's search.json but for its "seconds", the merge's own time).

    python3 bench/shard_cpu_time.py build/kvsim CONFIG [SHARDS] [REPEATS] [--threads N] [--search]

Prints each repeat and the medians, and beside them the CPU time of `kvsim --version` (what each
process pays to start, mostly the dynamic loader) times the processes the shards add: the part of
the difference that no division of the work can remove. Run from the repository root.
"""
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile


def cpu_seconds(command):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def outputs(folder, search):
    """The files one process and the merge both write, as bytes; search.json without its timing."""
    names = sorted(n for n in os.listdir(folder) if not n.startswith("partial-")) if search else \
        ["results.csv", "results.json"]
    files = {}
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            data = f.read()
        if name == "search.json":
            data = b"".join(line for line in data.splitlines(True) if not line.lstrip().startswith(b'"seconds"'))
        files[name] = data
    return files


def main():
    args = sys.argv[1:]
    threads = []
    if "--threads" in args:
        at = args.index("--threads")
        threads = ["--threads", args[at + 1]]
        del args[at:at + 2]
    search = "--search" in args
    if search:
        args.remove("--search")
    command = "search" if search else "sweep"
    kvsim, config = args[0], args[1]
    shards = int(args[2]) if len(args) > 2 else 4
    repeats = int(args[3]) if len(args) > 3 else 5
    scratch = tempfile.mkdtemp(prefix="kvsim-shard-cpu-%d-" % os.getpid())
    whole_cpu, split_cpu, start_cpu = [], [], []
    try:
        for r in range(repeats):
            start_cpu.append(cpu_seconds([kvsim, "--version"]))
            whole = os.path.join(scratch, "whole")
            shutil.rmtree(whole, ignore_errors=True)
            one = cpu_seconds([kvsim, command, config, "--out", whole, "-q", *threads])
            split = os.path.join(scratch, "split")
            shutil.rmtree(split, ignore_errors=True)
            parts = sum(cpu_seconds([kvsim, command, config, "--shard", "%d/%d" % (i, shards), "--out", split, "-q",
                                     *threads]) for i in range(shards))
            parts += cpu_seconds([kvsim, "merge", split, "-q"])
            expected, got = outputs(whole, search), outputs(split, search)
            for name in expected:
                if got.get(name) != expected[name]:
                    sys.exit("%s differs between one process and the merged shards" % name)
            whole_cpu.append(one)
            split_cpu.append(parts)
            print("repeat %d: one process %.3f s CPU, %d shards + merge %.3f s CPU (%.3fx)" %
                  (r, one, shards, parts, parts / one))
        a, b, s = statistics.median(whole_cpu), statistics.median(split_cpu), statistics.median(start_cpu)
        print("median: one process %.3f s, %d shards + merge %.3f s: %.3fx; results identical" % (a, shards, b, b / a))
        print("start-up: kvsim --version %.3f s; x %d processes more than one: %.3f s of the %.3f s difference" %
              (s, shards, s * shards, b - a))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
