#!/usr/bin/python3
"""By hand, never by a test: gives kvpress's PerLayerCompressionPress (its own code, through the
oracle harness run_press.py) the per-layer ratios of a profile fitted by `kvsim search` with
`deploy: kvpress`, on the prompts the profile was fitted for, and records what kvpress keeps:
per layer and KV head, the kept prompt positions. tests/unit/test_prompt_press.cpp checks that
kvsim's replay keeps exactly these, and tests/cli_search_test.py that the search fits these ratios
and plans these counts.

  /usr/bin/python3 tests/goldens/record_kvpress_per_layer.py HARNESS_DIR build/tests/dump_prompt_npy RATIOS.json

RATIOS.json: `kvsim export PROFILE --format ratios` of the search in cli_search_test.py's
test_kvpress_deploy (snapkv_press, window 16, prompt {tokens: 64}, trace max_steps 96, a grid of
ratios up to 0.7 so that every layer keeps more than SnapKV's window: below it kvpress gives the
window's positions equal scores and torch.topk's tie order, not kvpress's semantics, decides).
Queries are given after RoPE (--no-rope), as kvsim's traces hold them.
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
TRACE = "data/tinystories-stories260K.h5"
PRESS, PARAMS, PROMPT, SEQUENCES, LAYERS = "snapkv", {"window_size": 16, "kernel_size": 5}, 64, (3, 4), 5


def main():
    harness, dump, ratios_path = sys.argv[1], sys.argv[2], sys.argv[3]
    with open(ratios_path) as f:
        ratios = json.load(f)  # as a kvpress user loads the file
    goldens = {"kvpress_commit": "8bb29b9c3078452a86d692f29123fa6c793e2b05", "trace": TRACE,
               "policy": "snapkv_press", "params": PARAMS, "prompt": PROMPT, "ratios": ratios, "sequences": []}
    for sequence in SEQUENCES:
        layers = []
        for layer in range(LAYERS):
            with tempfile.TemporaryDirectory() as d:
                subprocess.run([dump, os.path.join(ROOT, TRACE), str(sequence), str(layer), str(PROMPT), d], check=True)
                cmd = ["/usr/bin/python3", os.path.join(harness, "run_press.py"), "--press", PRESS,
                       "--keys", os.path.join(d, "keys.npy"), "--values", os.path.join(d, "values.npy"),
                       "--queries", os.path.join(d, "queries.npy"), "--no-rope", "--format", "json",
                       "--layer-idx", str(layer), "--per-layer-ratios", ",".join(repr(r) for r in ratios)]
                for name, value in PARAMS.items():
                    cmd += ["--set", "%s=%s" % (name, value)]
                out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
                layers.append([h["kept_sorted"] for h in out["heads"]])
        goldens["sequences"].append({"sequence": sequence, "kept": layers})
    text = json.dumps(goldens, separators=(",", ":")).replace('{"sequence"', '\n{"sequence"')
    with open(os.path.join(HERE, "kvpress_per_layer.json"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
