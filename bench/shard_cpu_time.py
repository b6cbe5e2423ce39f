#!/usr/bin/env python3
"""By hand: the CPU time (user + sys) of a sweep split into shards run as separate processes, plus
their merge, against the same sweep in one process; the merged files are checked byte for byte.

    python3 bench/shard_cpu_time.py build/kvsim CONFIG [SHARDS] [REPEATS] [--threads N]

Prints each repeat and the medians. Run from the repository root.
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


def main():
    args = sys.argv[1:]
    threads = []
    if "--threads" in args:
        at = args.index("--threads")
        threads = ["--threads", args[at + 1]]
        del args[at:at + 2]
    kvsim, config = args[0], args[1]
    shards = int(args[2]) if len(args) > 2 else 4
    repeats = int(args[3]) if len(args) > 3 else 5
    scratch = tempfile.mkdtemp(prefix="kvsim-shard-cpu-%d-" % os.getpid())
    whole_cpu, split_cpu = [], []
    try:
        for r in range(repeats):
            whole = os.path.join(scratch, "whole")
            one = cpu_seconds([kvsim, "sweep", config, "--out", whole, "-q", *threads])
            split = os.path.join(scratch, "split")
            shutil.rmtree(split, ignore_errors=True)
            parts = sum(cpu_seconds([kvsim, "sweep", config, "--shard", "%d/%d" % (i, shards), "--out", split, "-q",
                                     *threads]) for i in range(shards))
            parts += cpu_seconds([kvsim, "merge", split, "-q"])
            for name in ("results.csv", "results.json"):
                with open(os.path.join(whole, name), "rb") as a, open(os.path.join(split, name), "rb") as b:
                    if a.read() != b.read():
                        sys.exit("%s differs between one process and the merged shards" % name)
            whole_cpu.append(one)
            split_cpu.append(parts)
            print("repeat %d: one process %.3f s CPU, %d shards + merge %.3f s CPU (%.3fx)" %
                  (r, one, shards, parts, parts / one))
        a, b = statistics.median(whole_cpu), statistics.median(split_cpu)
        print("median: one process %.3f s, %d shards + merge %.3f s: %.3fx; results identical" % (a, shards, b, b / a))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
