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

    python3 bench/pipeline.py [--sequences 8] [--tokens 4096] [--layers 16] [--type Q4_K]
                              [--heldout 2] [--sample 0.125] [--screen STEPS[:KEEP]] [--coarse-grid N]
                              [--targets 2x,4x] [--generate 32]
                              [--dir DIR] [--build build]

The defaults are issue 34's 1B case (8 x 4,096 tokens, 16 layers); --sequences 3 --tokens 1024
--layers 2 --heldout 1 --targets 2x,3x is a look in minutes (at 1,024 tokens 4x is below what a
streaming head's sinks and recent window of 64 hold, and the search says so). Run from the repository root after `ninja -C build`. Prints one
line a stage (the search's followed by its own stages' wall times) and a total; the search's
report is in DIR/search/.
"""
import argparse
import json
import os
import subprocess
import sys
import time

SEPARATOR = "\n@@@\n"  # bench_capture's text: sequences split by a line "@@@"


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

    config = stem + "-search.yaml"
    heldout = list(range(args.sequences - args.heldout, args.sequences))
    with open(config, "w") as out:
        # Paths are written as YAML double-quoted strings (json.dumps gives a valid one).
        out.write(f"trace: {json.dumps(trace)}\n"
                  "search:\n"
                  "  policy: {h2o: {recent_window: 64}}\n"
                  f"  split: {{heldout: {heldout}}}\n"
                  f"  target: [{', '.join(t.strip() for t in args.targets.split(','))}]\n"
                  "  objective: output_rel_error\n"
                  "  fit: [layer_budgets, head_budgets, streaming, tiers]\n"
                  "  streaming: {sinks: 4, recent: 64}\n"
                  "  tiers: {recent: 64}\n"
                  + (f"  sample: {{steps: {args.sample!r}, seed: 1}}\n" if args.sample < 1 else "")
                  + screen
                  + (f"  coarse_grid: {args.coarse_grid}\n" if args.coarse_grid else "")
                  + f"output: {{dir: {json.dumps(search_dir)}}}\n")

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


if __name__ == "__main__":
    main()
