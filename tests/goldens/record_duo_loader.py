#!/usr/bin/python3
"""By hand, never by a test: loads a DuoAttention pattern folder exported by kvsim (`kvsim export
PROFILE --format duo` of the search in cli_search_test.py's test_duo_deploy) with DuoAttention's own
loader and threshold (load_attn_pattern + sparsify_attention_heads, through the oracle harness
run_duo_loader.py, numpy seed 42 as its LongBench script seeds it), at every sparsity of the
profile's sparsity_curve, and records what it returns into duo_loader.json: per sparsity the 0/1
matrix (1 = full head, 0 = streaming head), and the sink and recent sizes it read.

  /usr/bin/python3 tests/goldens/record_duo_loader.py HARNESS_DIR PATTERN_DIR PROFILE.json
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    harness, folder, profile_path = sys.argv[1], sys.argv[2], sys.argv[3]
    with open(profile_path) as f:
        profile = json.load(f)
    with open(os.path.join(folder, "full_attention_heads.tsv")) as f:
        tsv = f.read()
    goldens = {"duo_attention_commit": "fe93c314ae87306ef6629dc16713250b4718ffe7", "seed": 42,
               "full_attention_heads.tsv": tsv, "loads": []}
    for point in profile["sparsity_curve"]:
        cmd = ["/usr/bin/python3", os.path.join(harness, "run_duo_loader.py"), folder, repr(point["sparsity"]),
               "--format", "json", "--stability", "10"]
        out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        goldens["sink_size"], goldens["recent_size"] = out["sink_size"], out["recent_size"]
        goldens["loads"].append({"sparsity": point["sparsity"], "n_streaming": out["n_streaming"],
                                 "distinct_matrices_over_10_seeds": out["stability"]["distinct_matrices"],
                                 "matrix": out["matrix"]})
    text = json.dumps(goldens, separators=(",", ":")).replace('{"sparsity"', '\n{"sparsity"')
    with open(os.path.join(HERE, "duo_loader.json"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
