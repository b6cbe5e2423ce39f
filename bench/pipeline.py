#!/usr/bin/env python3
"""By hand: kvsim's whole pipeline on a synthetic Llama-3.2-1B-shaped quantised model, one stage
after another, each stage's wall time, CPU time and peak resident memory measured on its own
process (os.wait4):

  1. model    bench_capture --model-only writes the random-weight GGUF and a text (once; kept)
  2. capture  kvsim capture of --sequences x --tokens tokens into a trace
  3. search   kvsim search: H2O layer and head budgets, streaming heads and tier profiles at two
              targets, the last --heldout sequences held out, output error on a --sample of the
              decode steps (1: every step)
  4. export   kvsim export of the fitted profile as per-layer ratios
  5. generate kvsim generate with the fitted tier profile in the runtime, --generate tokens
  6. with --against-exhaustive: the same search without its shortcuts (every decode step, every
              grid budget, every tier candidate) on the same trace, then both searches' fitted
              profiles replayed exactly (kvsim run, every held-out step) and compared: the gap of
              each fast profile over the exhaustive one's, and whether the fast search's interval
              covered its exact figure. The exhaustive search grows with the tokens squared:
              on 2 cores about 10 minutes at --layers 2 --tokens 2048, 46 at 4,096.

    python3 bench/pipeline.py [--sequences 8] [--tokens 4096] [--layers 16] [--type Q4_K]
                              [--heldout 2] [--sample 0.125] [--screen STEPS[:KEEP]] [--coarse-grid N]
                              [--targets 2x,4x] [--generate 32] [--against-exhaustive]
                              [--dir DIR] [--build build]

The defaults are issue 34's 1B case (8 x 4,096 tokens, 16 layers); --sequences 3 --tokens 1024
--layers 2 --heldout 1 --targets 2x,3x is a look in minutes (at 1,024 tokens 4x is below what a
streaming head's sinks and recent window of 64 hold, and the search says so). Run from the repository root after `ninja -C build`. Prints one
line a stage (the search's followed by its own stages' wall times) and a total; the search's
report is in DIR/search/.
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import time

SEPARATOR = "\n@@@\n"  # bench_capture's text: sequences split by a line "@@@"
FITS = ["layer_budgets", "head_budgets", "streaming", "tiers"]


def run_stage(name, command, log):
    """Runs `command` as its own process; returns (wall s, CPU s, peak RSS GiB)."""
    with open(log, "w") as out:
        start = time.monotonic()
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.monotonic() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"pipeline: stage {name} failed (exit {code}); its output: {log}")
    cpu = usage.ru_utime + usage.ru_stime
    rss = usage.ru_maxrss / (1024.0 * 1024.0)  # KiB to GiB
    print(f"{name:9s} {wall:9.1f} s wall {cpu:9.1f} s CPU {rss:7.2f} GiB peak", flush=True)
    return wall, cpu, rss


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--type", default="Q4_K", choices=["F32", "Q8_0", "Q4_K", "Q6_K"])
    parser.add_argument("--heldout", type=int, default=2, help="the last N sequences are held out")
    parser.add_argument("--sample", type=float, default=0.125, help="search.sample steps (1: exact)")
    parser.add_argument("--screen", default="", help="search.screen: the tier candidates screened on the first STEPS "
                                                      "decode steps, KEEP a head (default 10) replayed in full")
    parser.add_argument("--coarse-grid", type=int, default=0, help="search.coarse_grid: the budget fits measure every "
                                                                      "Nth grid budget first, then refine (0: every one)")
    parser.add_argument("--generate", type=int, default=32, help="tokens kvsim generate writes")
    parser.add_argument("--targets", default="2x,4x", help="search.target, comma-separated")
    parser.add_argument("--against-exhaustive", action="store_true",
                        help="then an exhaustive search of the same trace (every step, every grid budget, every tier "
                             "candidate) and both searches' fitted profiles replayed exactly on the held-out sequences")
    parser.add_argument("--dir", default="/tmp/kvsim-pipeline")
    parser.add_argument("--build", default="build")
    args = parser.parse_args()
    if not 0 < args.heldout < args.sequences:
        sys.exit("pipeline: --heldout must leave at least one sequence to fit on")
    if not 0 < args.sample <= 1:
        sys.exit("pipeline: --sample must be in (0, 1]")
    screen = ""
    if args.screen:
        steps, _, keep = args.screen.partition(":")
        if not steps.isdigit() or (keep and not keep.isdigit()):
            sys.exit("pipeline: --screen must be STEPS or STEPS:KEEP, e.g. 1024:10")
        screen = f"  screen: {{steps: {int(steps)}, keep: {int(keep or 10)}}}\n"
    if args.coarse_grid == 1 or args.coarse_grid < 0:
        sys.exit("pipeline: --coarse-grid must be 0 (every grid budget) or at least 2")
    targets = [t.strip() for t in args.targets.split(",")]
    os.makedirs(args.dir, exist_ok=True)
    kvsim = os.path.join(args.build, "kvsim")
    stem = os.path.join(args.dir, f"{args.sequences}x{args.tokens}-l{args.layers}-{args.type}")
    trace, search_dir = stem + ".h5", stem + "-search"
    print(f"pipeline: {args.sequences} x {args.tokens} tokens, {args.layers} layers of Llama-3.2-1B's shape, "
          f"{args.type} weights, sample {args.sample:g}" + (f", screen {args.screen}" if args.screen else "") +
          (f", coarse grid {args.coarse_grid}" if args.coarse_grid else "") +
          f"; {os.cpu_count()} CPUs", flush=True)

    # bench_capture names the model and text it writes; --model-only prints them.
    printed = subprocess.run([os.path.join(args.build, "bench", "bench_capture"), "--model-only",
                              "--tokens", str(args.tokens), "--sequences", str(args.sequences),
                              "--layers", str(args.layers), "--type", args.type, "--dir", args.dir],
                             check=True, capture_output=True, text=True).stdout
    paths = dict(line.split(" ", 1) for line in printed.splitlines() if line.startswith(("model ", "text ")))
    model, text = paths["model"], paths["text"]

    heldout = list(range(args.sequences - args.heldout, args.sequences))

    def write_search_config(path, output_dir, fast):
        """The search's config; fast=False leaves out every shortcut (sample, screen, coarse grid)."""
        with open(path, "w") as out:
            # Paths are written as YAML double-quoted strings (json.dumps gives a valid one).
            out.write(f"trace: {json.dumps(trace)}\n"
                      "search:\n"
                      "  policy: {h2o: {recent_window: 64}}\n"
                      f"  split: {{heldout: {heldout}}}\n"
                      f"  target: [{', '.join(targets)}]\n"
                      "  objective: output_rel_error\n"
                      f"  fit: [{', '.join(FITS)}]\n"
                      "  streaming: {sinks: 4, recent: 64}\n"
                      "  tiers: {recent: 64}\n"
                      + (f"  sample: {{steps: {args.sample!r}, seed: 1}}\n" if fast and args.sample < 1 else "")
                      + (screen if fast else "")
                      + (f"  coarse_grid: {args.coarse_grid}\n" if fast and args.coarse_grid else "")
                      + f"output: {{dir: {json.dumps(output_dir)}}}\n")

    config = stem + "-search.yaml"
    write_search_config(config, search_dir, fast=True)

    totals = [0.0, 0.0, 0.0]
    stages = [
        ("capture", [kvsim, "capture", "--model", model, "--text", text, "--split-on", SEPARATOR,
                     "--max-tokens", str(args.tokens), "--context", str(args.tokens), "-o", trace, "-q"]),
        ("search", [kvsim, "search", config, "-q"]),
        ("export", [kvsim, "export", os.path.join(search_dir, "profile.json"), "--format", "ratios",
                    "-o", stem + "-ratios.json"]),
        ("generate", [kvsim, "generate", "--model", model, "--profile",
                      os.path.join(search_dir, "profile-tiers-2x.json"), "--prompt", "the cat 3 sat.",
                      "-n", str(args.generate)]),
    ]
    for name, command in stages:
        wall, cpu, rss = run_stage(name, command, f"{stem}-{name}.log")
        totals = [totals[0] + wall, totals[1] + cpu, max(totals[2], rss)]
        if name == "search":  # where its time went, as search.json records it
            with open(os.path.join(search_dir, "search.json")) as f:
                parts = json.load(f)["stage_seconds"]
            print("          " + ", ".join(f"{p['stage']} {p['seconds']:.1f} s" for p in parts), flush=True)
    print(f"{'total':9s} {totals[0]:9.1f} s wall {totals[1]:9.1f} s CPU {totals[2]:7.2f} GiB peak "
          f"(the model's writing not counted); logs: {stem}-*.log")
    if args.against_exhaustive:
        compare_with_exhaustive(kvsim, stem, trace, heldout, search_dir, write_search_config, targets)


def fitted_profiles(search_dir, targets):
    """(fit, target, path) of each profile a search writes, in the order the replays list them."""
    return [(fit, target, os.path.join(search_dir, f"profile-{fit}-{target}.json")) for fit in FITS for target in targets]


def replay_config(path, trace, heldout, profiles, output_dir):
    """A kvsim run config replaying profiles on the held-out sequences, every step."""
    with open(path, "w") as out:
        out.write(f"trace: {{path: {json.dumps(trace)}, sequences: {heldout}}}\n"
                  "policies:\n" + "".join(f"  - profile: {json.dumps(p)}\n" for _, _, p in profiles) +
                  "metrics: [output_rel_error]\n"
                  f"output: {{dir: {json.dumps(output_dir)}}}\n")


def compare_with_exhaustive(kvsim, stem, trace, heldout, search_dir, write_search_config, targets):
    """Issue 34's check of the shortcuts together: the exhaustive search's fitted profiles against
    the fast one's, each replayed exactly by kvsim run, and the fast search's interval."""
    exhaustive_dir = stem + "-exhaustive"
    config = stem + "-exhaustive.yaml"
    write_search_config(config, exhaustive_dir, fast=False)
    run_stage("exhaustive", [kvsim, "search", config, "-q"], f"{stem}-exhaustive.log")
    profiles = {"fast": fitted_profiles(search_dir, targets), "exhaustive": fitted_profiles(exhaustive_dir, targets)}
    exact = {}
    for name in ("fast", "exhaustive"):
        replay = f"{stem}-replay-{name}.yaml"
        replay_config(replay, trace, heldout, profiles[name], f"{stem}-replay-{name}")
        run_stage(f"replay {name}", [kvsim, "run", replay, "-q"], f"{stem}-replay-{name}.log")
        with open(os.path.join(f"{stem}-replay-{name}", "results.json")) as f:
            exact[name] = [row["output_rel_error"] for row in json.load(f)]
    # The exhaustive search measured every step: its profiles' recorded held-out figures are exact,
    # and kvsim run must give them to the last bit.
    recorded = []
    for _, _, path in profiles["exhaustive"]:
        with open(path) as f:
            recorded.append(json.load(f)["heldout"]["value"])
    print("the exhaustive search's recorded held-out figures "
          + ("equal kvsim run's to the bit" if recorded == exact["exhaustive"] else
             f"DIFFER from kvsim run's: {recorded} against {exact['exhaustive']}"))
    # The fast search's own estimate and interval of each fitted profile (search.csv's record of
    # the method the profile names).
    with open(os.path.join(search_dir, "search.csv")) as f:
        records = {(row["method"], row["target"]): row for row in csv.DictReader(f)}
    print(f"{'fit':14s} {'target':6s} {'exhaustive':>11s} {'fast':>11s} {'gap':>8s} "
          f"{'fast estimate':>24s}  covers")
    worst, covered = 0.0, 0
    for i, (fit, target, path) in enumerate(profiles["fast"]):
        with open(path) as f:
            method = json.load(f)["method"]
        record = records[(method, target)]
        estimate = float(record["heldout"])
        half = float(record["heldout_interval"]) if record["heldout_interval"] else 0.0
        fast, full = exact["fast"][i], exact["exhaustive"][i]
        gap = fast / full - 1.0
        covers = abs(estimate - fast) <= half
        worst, covered = max(worst, gap), covered + covers
        print(f"{fit:14s} {target:6s} {full:11.6f} {fast:11.6f} {100 * gap:+7.2f}% "
              f"{estimate:11.6f} +- {half:9.6f}  {'yes' if covers else 'no'}", flush=True)
    print(f"the fast search's fitted profiles at most {100 * worst:+.2f}% over the exhaustive search's held out "
          f"(exact replays); its intervals covered {covered} of {len(profiles['fast'])}")


if __name__ == "__main__":
    main()
