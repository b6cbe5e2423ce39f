#!/usr/bin/python3
"""By hand, never by a test: records the kept sets of NVIDIA kvpress's own presses into
kvpress_kept.json, which tests/unit/test_prompt_press.cpp checks kvsim's presses against.

  /usr/bin/python3 tests/goldens/record_kvpress.py HARNESS_DIR build/tests/dump_prompt_npy

HARNESS_DIR holds run_press.py, a harness that runs a kvpress press's forward_hook (its real
score() and compress()) on .npy tensors and prints the kept positions per KV head (see README.md).
Needs numpy and torch (Debian's python3-torch). Inputs:
  synthetic: 40 positions, 2 KV heads of 2 query heads, head size 8, built from the formula in
             tensor() below (exact in float32), which the C++ test rebuilds;
  stories260K: the first 361 positions (sequence 3 less its last 64) of layer 2 of
             data/tinystories-stories260K.h5, dumped by dump_prompt_npy.
Queries are given after RoPE (--no-rope), as kvsim's traces hold them.
"""
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))


def tensor(salt, shape):
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.uint64)
    x = (i * np.uint64(2654435761) + np.uint64(salt * 40503)) % np.uint64(2 ** 32)
    v = ((x >> np.uint64(8)) % np.uint64(2001)).astype(np.int64) - 1000
    return (v.astype(np.float64) / 1024.0).astype(np.float32).reshape(shape)


def write_synthetic(d, S=40, D=8, HKV=2, G=2):
    q, k, v = tensor(1, (S, HKV * G, D)), tensor(2, (S, HKV, D)), tensor(3, (S, HKV, D))
    for name, x in (("queries", q), ("keys", k), ("values", v)):
        np.save(os.path.join(d, name + ".npy"), x.transpose(1, 0, 2)[None].copy())


def write_attentions(d):
    """The causal softmax an eager attention layer returns, float32: what ObservedAttentionPress reads."""
    q = torch.from_numpy(np.load(os.path.join(d, "queries.npy")))
    k = torch.from_numpy(np.load(os.path.join(d, "keys.npy")))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    S = q.shape[2]
    w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.shape[3])
    w = w + torch.triu(torch.full((S, S), float("-inf")), diagonal=1)
    np.save(os.path.join(d, "attentions.npy"), torch.softmax(w, dim=-1, dtype=torch.float32).numpy())


# (kvsim policy, kvpress harness name, params, ratio)
SYNTHETIC = [
    ("snapkv_press", "snapkv", {"window_size": 8, "kernel_size": 5}, 0.55),
    ("snapkv_press", "snapkv", {"window_size": 8, "kernel_size": 3}, 0.3),
    ("tova_press", "tova", {}, 0.55),
    ("observed_attention_press", "observed", {}, 0.55),
    ("knorm_press", "knorm", {}, 0.55),
    ("streaming_llm_press", "streamingllm", {"n_sink": 4}, 0.55),
    ("keydiff_press", "keydiff", {}, 0.55),
    ("cur_press", "cur", {"num_sinks": 4, "local_window_size": 16}, 0.55),
    ("noncausal_press", "noncausal", {"chunk_size": 16}, 0.55),
    ("noncausal_press", "noncausal", {"chunk_size": 8}, 0.55),
    ("lagkv_press", "lagkv", {"n_sink": 4, "lag_size": 8}, 0.51),  # 19 kept: no tied rank cut
    ("lagkv_press", "lagkv", {"n_sink": 4, "lag_size": 32}, 0.55),  # shorter than n_sink + 2 lags
]
STORIES = [
    ("snapkv_press", "snapkv", {"window_size": 64, "kernel_size": 5}, 0.6),
    ("tova_press", "tova", {}, 0.6),
    ("observed_attention_press", "observed", {}, 0.6),
    ("knorm_press", "knorm", {}, 0.6),
    ("streaming_llm_press", "streamingllm", {"n_sink": 4}, 0.6),
    ("keydiff_press", "keydiff", {}, 0.6),
    ("cur_press", "cur", {"num_sinks": 4, "local_window_size": 16}, 0.6),
    ("noncausal_press", "noncausal", {"chunk_size": 256}, 0.6),
    ("lagkv_press", "lagkv", {"n_sink": 4, "lag_size": 128}, 0.3),  # 252 kept: every tie kept whole
]


def run(harness, d, press, params, ratio):
    cmd = ["/usr/bin/python3", os.path.join(harness, "run_press.py"), "--press", press, "--ratio", repr(ratio),
           "--keys", os.path.join(d, "keys.npy"), "--values", os.path.join(d, "values.npy"),
           "--queries", os.path.join(d, "queries.npy"), "--no-rope", "--format", "json"]
    if press == "observed":
        cmd += ["--attentions", os.path.join(d, "attentions.npy")]
    for name, value in params.items():
        cmd += ["--set", "%s=%s" % (name, value)]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return [h["kept_sorted"] for h in out["heads"]]


def record(harness, d, cases):
    return [{"policy": policy, "params": params, "ratio": ratio, "kept": run(harness, d, press, params, ratio)}
            for policy, press, params, ratio in cases]


def main():
    harness, dump = sys.argv[1], sys.argv[2]
    goldens = {"kvpress_commit": "8bb29b9c3078452a86d692f29123fa6c793e2b05"}
    with tempfile.TemporaryDirectory() as d:
        write_synthetic(d)
        write_attentions(d)
        goldens["synthetic"] = {"positions": 40, "kv_heads": 2, "group": 2, "head_dim": 8,
                                "cases": record(harness, d, SYNTHETIC)}
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([dump, os.path.join(ROOT, "data", "tinystories-stories260K.h5"), "3", "2", "361", d], check=True)
        write_attentions(d)
        goldens["stories260K"] = {"trace": "data/tinystories-stories260K.h5", "sequence": 3, "layer": 2,
                                  "prompt": 361, "cases": record(harness, d, STORIES)}
    # One case a line.
    text = json.dumps(goldens, separators=(",", ":"))
    text = text.replace('{"policy"', '\n{"policy"').replace(',"stories260K"', ',\n"stories260K"')
    with open(os.path.join(HERE, "kvpress_kept.json"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
