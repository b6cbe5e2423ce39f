"""Hostile model and text input on the kvsim command line: every bad GGUF or text is one line
`kvsim: error: <file>: <key or tensor>: <what>` with exit status 2, never a crash, a hang, a huge
allocation or a trace with non-finite values in it.

The models are tiny Llama GGUFs written here (a few KB), each broken in one way.
Run by meson test as: python3 tests/cli_model_input_test.py build/kvsim
"""
import csv
import json
import math
import os
import random
import shutil
import struct
import sys
import unittest

import cli_common
from cli_common import KvsimTestCase, kvsim

# GGUF value type ids (ggml/docs/gguf.md).
UINT32, INT32, FLOAT32, STRING, ARRAY, UINT64, INT64, FLOAT64 = 4, 5, 6, 8, 9, 10, 11, 12
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f", 7: "<B",
                  UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}

SHARED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared")
STORIES_MODEL = os.path.join(SHARED, "models", "stories260K", "stories260K.gguf")


def encode_value(value_type, value):
    if value_type == STRING:
        data = value.encode() if isinstance(value, str) else value
        return struct.pack("<Q", len(data)) + data
    if value_type == ARRAY:
        element_type, items = value
        return struct.pack("<IQ", element_type, len(items)) + b"".join(encode_value(element_type, v) for v in items)
    return struct.pack(SCALAR_FORMATS[value_type], value)


def string_bytes(text):
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


class TinyLlama:
    """A Llama GGUF with random F32 weights: dim 8, one layer, two query heads sharing one KV head,
    and a SentencePiece vocabulary of <unk> <s> </s>, the 256 byte tokens and a few pieces."""

    def __init__(self, seed=1):
        self.dim, self.hidden, self.heads, self.kv_heads, self.head_dim = 8, 16, 2, 1, 4
        pieces = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)] + \
                 ["\u2581", "e", "t", "\u2581t", "he", "\u2581the"]
        types = [2, 3, 3] + [6] * 256 + [1] * 6
        scores = [0.0] * 259 + [-float(i) for i in range(6)]
        self.vocab = len(pieces)
        self.metadata = {
            "general.architecture": (STRING, "llama"),
            "llama.context_length": (UINT32, 64),
            "llama.embedding_length": (UINT32, self.dim),
            "llama.feed_forward_length": (UINT32, self.hidden),
            "llama.block_count": (UINT32, 1),
            "llama.attention.head_count": (UINT32, self.heads),
            "llama.attention.head_count_kv": (UINT32, self.kv_heads),
            "llama.rope.dimension_count": (UINT32, self.head_dim),
            "llama.attention.layer_norm_rms_epsilon": (FLOAT32, 1e-5),
            "tokenizer.ggml.model": (STRING, "llama"),
            "tokenizer.ggml.tokens": (ARRAY, (STRING, pieces)),
            "tokenizer.ggml.scores": (ARRAY, (FLOAT32, scores)),
            "tokenizer.ggml.token_type": (ARRAY, (INT32, types)),
            "tokenizer.ggml.bos_token_id": (UINT32, 1),
            "tokenizer.ggml.eos_token_id": (UINT32, 2),
        }
        rng = random.Random(seed)
        d, h, q, kv = self.dim, self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim

        def matrix(rows, cols):  # uniform with variance 1 / cols, stored ne = [cols, rows]
            bound = math.sqrt(3.0 / cols)
            return [cols, rows], [rng.uniform(-bound, bound) for _ in range(rows * cols)]

        self.tensors = {"token_embd.weight": matrix(self.vocab, d)}
        for name, shape in (("attn_norm", None), ("attn_q", (q, d)), ("attn_k", (kv, d)), ("attn_v", (kv, d)),
                            ("attn_output", (d, q)), ("ffn_norm", None), ("ffn_gate", (h, d)),
                            ("ffn_up", (h, d)), ("ffn_down", (d, h))):
            self.tensors["blk.0.%s.weight" % name] = ([d], [1.0] * d) if shape is None else matrix(*shape)
        self.tensors["output_norm.weight"] = ([d], [1.0] * d)
        self.tensors["output.weight"] = matrix(self.vocab, d)
        self.offsets = {}  # tensor name -> offset written in place of the real one

    def set(self, key, value_type, value):
        self.metadata[key] = (value_type, value)
        return self

    def scale(self, name, factor):
        shape, values = self.tensors[name]
        self.tensors[name] = (shape, [v * factor for v in values])
        return self

    def bytes(self):
        alignment = 32
        header = b"GGUF" + struct.pack("<IQQ", 3, len(self.tensors), len(self.metadata))
        for key, (value_type, value) in self.metadata.items():
            header += string_bytes(key) + struct.pack("<I", value_type) + encode_value(value_type, value)
        data, infos = b"", b""
        for name, (shape, values) in self.tensors.items():
            offset = self.offsets.get(name, len(data))
            infos += string_bytes(name) + struct.pack("<I", len(shape)) + struct.pack("<%dQ" % len(shape), *shape)
            infos += struct.pack("<IQ", 0, offset)
            data += struct.pack("<%df" % len(values), *values)
            data += b"\0" * (-len(data) % alignment)
        header += infos
        header += b"\0" * (-len(header) % alignment)
        return header + data

    def data_offset(self):
        """Where the data section starts (the header, padded)."""
        saved, self.offsets = self.offsets, {}
        full = self.bytes()
        self.offsets = saved
        data_bytes = sum(4 * len(v) + (-4 * len(v) % 32) for _, v in self.tensors.values())
        return len(full) - data_bytes


class ModelInput(KvsimTestCase):
    outputs = ("t.h5", "o")  # the trace and the results folder

    def setUp(self):
        super().setUp()
        self.text = self.path("story.txt")
        with open(self.text, "w") as f:
            f.write("the tet he the\n<|endoftext|>\nthe hat\n")
        self.config = self.path("e.yaml")
        with open(self.config, "w") as f:
            f.write("budgets: [4]\npolicies: [tova]\n")

    def model(self, llama, name="m.gguf"):
        path = self.path(name)
        with open(path, "wb") as f:
            f.write(llama.bytes() if isinstance(llama, TinyLlama) else llama)
        return path

    def clean_outputs(self):
        if os.path.exists(self.path("t.h5")):
            os.remove(self.path("t.h5"))
        if os.path.exists(self.path("o")):
            shutil.rmtree(self.path("o"))

    # --max-memory is kvsim's own option: it goes before the command. Each run starts with no
    # outputs, so that assert_input_error's "nothing written" sees this run's.
    def capture(self, model, *extra, text=None, max_memory=None):
        self.clean_outputs()
        memory = ["--max-memory", max_memory] if max_memory else []
        return kvsim(*memory, "capture", "--model", model, "--text", text or self.text, "--split-on",
                     "<|endoftext|>", "-o", self.path("t.h5"), *extra)

    def eval(self, model, *extra, text=None, max_memory=None):
        self.clean_outputs()
        memory = ["--max-memory", max_memory] if max_memory else []
        return kvsim(*memory, "eval", self.config, "--model", model, "--text", text or self.text, "--split-on",
                     "<|endoftext|>", "--out", self.path("o"), "-q", *extra)

    def assert_input_error(self, result, *fragments):
        super().assert_input_error(result, *fragments)
        self.assertTrue(result.stderr.startswith("kvsim: error: "), result.stderr)

    def test_the_tiny_model_is_valid(self):
        model = self.model(TinyLlama())
        result = self.capture(model)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("2 sequences", result.stdout)
        result = self.eval(model, "--format", "json")
        self.assertEqual(result.returncode, 0, result.stderr)

    def test_a_perplexity_beyond_a_double_is_inf_with_its_mean_nll(self):
        # A classifier 5000 times too large: logits in the thousands, a mean NLL far beyond the
        # 709.8 nats whose exp a double holds.
        model = self.model(TinyLlama().scale("output.weight", 5000.0))
        result = self.eval(model)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertRegex(result.stdout, r"full cache PPL inf \(mean NLL \d+\.\d{4} nats\)")
        self.assertRegex(result.stdout, r"  full +inf \(NLL \d+\.\d{4}\)\n")
        with open(self.path("o/results.json")) as f:
            records = json.load(f)
        full = records[0]
        self.assertEqual(full["policy"], "full")
        self.assertEqual(full["ppl"], "inf")
        self.assertGreater(full["nll"], 709.8)
        for r in records:  # numbers, or "inf" where a double cannot hold them; never null
            self.assertIsInstance(r["nll"], float)
            self.assertTrue(r["ppl"] == "inf" or isinstance(r["ppl"], float), r)
            self.assertTrue(r["delta_ppl"] in ("inf", "-inf") or isinstance(r["delta_ppl"], float), r)
        with open(self.path("o/results.csv")) as f:
            rows = list(csv.DictReader(f))
        self.assertEqual(rows[0]["ppl"], "inf")
        self.assertEqual(float(rows[0]["nll"]), full["nll"])
        with open(self.path("o/correlation.json")) as f:
            correlation = json.load(f)
        self.assertEqual(correlation["full_ppl"], "inf")
        self.assertEqual(correlation["full_nll"], full["nll"])
        # kvsim report reads the folder, leaving out of its figures what no axis holds.
        result = kvsim("report", self.path("o"))
        self.assertEqual(result.returncode, 0, result.stderr)

    def test_capture_context_layers_and_store(self):
        model = self.model(TinyLlama())  # trained context 64
        self.assert_input_error(self.capture(model, "--context", "65"), "m.gguf: --context 65 is beyond the model's "
                                "trained context of 64 positions (metadata key 'llama.context_length')")
        self.assert_input_error(self.capture(model, "--layers", "1"), "--layers: layer 1 is not in the model")
        self.assert_input_error(self.capture(model, "--layers", "0,0"), "--layers: 0 after 0")
        self.assert_input_error(self.capture(model.replace("m.gguf", "x.gguf")), "x.gguf")
        result = self.capture(model, "--context", "64", "--layers", "0", "--store", "fp16")
        self.assertEqual(result.returncode, 0, result.stderr)
        info = kvsim("trace", "info", self.path("t.h5"))
        self.assertIn("model layers     0", info.stdout)
        result = self.capture(model, "--store", "fp8")
        self.assertNotEqual(result.returncode, 0)
        self.assertFalse(os.path.exists(self.path("t.h5")))

    def test_an_unsupported_architecture_is_one_line_naming_it(self):
        model = self.model(TinyLlama().set("general.architecture", STRING, "gemma2"))
        self.assert_input_error(self.capture(model), "metadata key 'general.architecture': unsupported architecture "
                                "'gemma2' (supported: llama, qwen2)")

    # Class 1: integers that wrap or overflow, inconsistent shapes.

    def test_metadata_integers_out_of_range_name_the_key(self):
        cases = [
            # q_dim = 2 * (2^30 + 8) overflows an int (rope.dimension_count follows it, as it would in
            # a file made to pass that check).
            ("llama.attention.key_length", UINT32, 2**30 + 8, ("llama.rope.dimension_count", UINT32, 2**30 + 8)),
            ("llama.attention.key_length", UINT64, 2**63 + 4),  # above INT64_MAX
            ("llama.attention.key_length", UINT32, 3),          # odd: no RoPE pairs
            ("llama.block_count", UINT32, 0),
            ("llama.block_count", UINT64, 2**31),
            ("llama.block_count", INT32, -1),
            ("llama.block_count", UINT32, 2**31 - 1),           # more blocks than the file has tensors for
            ("llama.attention.head_count", UINT32, 0),
            ("llama.embedding_length", UINT32, 9),              # not a multiple of head_count 2
            ("llama.attention.head_count_kv", UINT32, 0),
            ("llama.attention.head_count_kv", UINT32, 4),       # more KV heads than query heads
            ("llama.embedding_length", UINT64, 2**32),
            ("llama.feed_forward_length", INT64, -16),
            ("llama.context_length", UINT32, 0),
            ("llama.context_length", UINT64, 2**31),
            ("llama.rope.dimension_count", UINT32, 2),
            ("llama.attention.value_length", UINT32, 8),
            ("llama.rope.freq_base", FLOAT64, 1e300),           # infinite as float32
            ("llama.rope.freq_base", FLOAT32, float("nan")),
            ("llama.attention.layer_norm_rms_epsilon", FLOAT64, 1e-300),  # 0 as float32
            ("llama.attention.layer_norm_rms_epsilon", FLOAT32, float("inf")),
            ("llama.vocab_size", UINT32, 7),                    # not the embedding's rows
            ("general.alignment", UINT32, 24),
            ("general.alignment", UINT64, 2**40),
            ("tokenizer.ggml.bos_token_id", UINT32, 10**6),
        ]
        for key, value_type, value, *also in cases:
            with self.subTest(key=key, value=value):
                llama = TinyLlama().set(key, value_type, value)
                for setting in also:
                    llama.set(*setting)
                model = self.model(llama)
                self.assert_input_error(self.capture(model), model + ": ", "'%s'" % key)

    def test_tensor_shapes_must_match_the_metadata(self):
        model = self.model(TinyLlama().set("llama.feed_forward_length", UINT32, 12))
        self.assert_input_error(self.capture(model), model + ": tensor 'blk.0.ffn_gate.weight': shape [8, 16]")
        llama = TinyLlama()
        llama.tensors["token_embd.weight"] = ([8, 2, 1], [0.5] * 16)
        model = self.model(llama)
        self.assert_input_error(self.capture(model), model + ": tensor 'token_embd.weight'")
        llama = TinyLlama()
        pieces = llama.metadata["tokenizer.ggml.tokens"][1][1]
        llama.tensors["token_embd.weight"] = ([8, 100], [0.5] * 800)  # fewer rows than tokens
        llama.tensors["output.weight"] = ([8, 100], [0.5] * 800)
        model = self.model(llama)
        self.assert_input_error(self.capture(model), model + ": metadata key 'tokenizer.ggml.tokens': %d tokens, "
                                "but tensor 'token_embd.weight' has 100 rows" % len(pieces))

    def test_tensor_offset_near_2_to_64_does_not_wrap(self):
        llama = TinyLlama()
        # begin = data_offset + offset wraps round to 0: the header would be read as weights.
        llama.offsets["blk.0.attn_q.weight"] = 2**64 - llama.data_offset()
        model = self.model(llama)
        self.assert_input_error(self.capture(model), model + ": tensor 'blk.0.attn_q.weight': data offset",
                                "past the end of the file")
        llama.offsets = {"output.weight": 2**63}
        model = self.model(llama)
        self.assert_input_error(self.capture(model), model + ": tensor 'output.weight'", "past the end of the file")

    def test_absurd_tensor_dimensions(self):
        llama = TinyLlama()
        llama.tensors["output_norm.weight"] = ([2**62], [1.0] * 8)
        model = self.model(llama)
        self.assert_input_error(self.capture(model), model + ": tensor info 'output_norm.weight': implausible shape")

    # Class 2: allocations sized by input.

    def test_a_huge_context_length_is_sized_by_the_text(self):
        for context in (2**31 - 1, 10**8):
            with self.subTest(context=context):
                model = self.model(TinyLlama().set("llama.context_length", UINT32, context))
                # Weights, cache and activations are a few KB here; a cache for the whole context
                # would be gigabytes.
                result = self.capture(model, max_memory="64M")
                self.assertEqual(result.returncode, 0, result.stderr)
                result = self.eval(model, "--format", "json", max_memory="64M")
                self.assertEqual(result.returncode, 0, result.stderr)

    def test_a_plan_over_the_memory_limit_is_one_line_naming_the_file(self):
        model = self.model(TinyLlama())
        self.assert_input_error(self.capture(model, max_memory="4K"), model + ": ", "needs",
                                "over the memory limit of 4096 bytes (--max-memory)")
        big = self.path("big.txt")
        with open(big, "w") as f:
            f.write("the " * 300000)
        self.assert_input_error(self.capture(model, text=big, max_memory="2M"), big + ": ", "needs",
                                "over the memory limit")
        # 50000 short sequences: reading the file takes 400 KB, the token ids kept add up past 500 KB.
        many = self.path("many.txt")
        with open(many, "w") as f:
            f.write("the|" * 50000)
        result = kvsim("--max-memory", "500000", "capture", "--model", model, "--text", many, "--split-on", "|",
                       "-o", self.path("t.h5"))
        self.assert_input_error(result, many + ": sequence ", "to tokenize needs", "over the memory limit")

    # Class 3: non-finite numbers.

    def test_non_finite_weights_name_the_tensor_and_element(self):
        for bad, word in ((float("nan"), "NaN"), (float("inf"), "infinite")):
            with self.subTest(value=bad):
                llama = TinyLlama()
                shape, values = llama.tensors["blk.0.attn_k.weight"]
                values[5] = bad
                model = self.model(llama)
                self.assert_input_error(self.capture(model),
                                        model + ": tensor 'blk.0.attn_k.weight': element 5 is " + word)

    def test_attention_that_overflows_stops_capture_and_eval(self):
        # Finite weights whose query·key overflows float: NaN attention if nothing stopped it.
        llama = TinyLlama().scale("blk.0.attn_q.weight", 1e20).scale("blk.0.attn_k.weight", 1e20)
        model = self.model(llama)
        where = "%s: %s sequence 0, layer 0, position 0: non-finite attention scores" % (model, self.text)
        self.assert_input_error(self.capture(model), where)
        self.assert_input_error(self.eval(model), where)

    def test_overflowing_logits_stop_eval(self):
        # Gains of 1e30 and weights of 1e20: every product is far past float's range.
        model = self.model(TinyLlama().scale("output_norm.weight", 1e30).scale("output.weight", 1e20))
        self.assert_input_error(self.eval(model), model + ": " + self.text + " sequence 0, position 0: non-finite logits")

    def test_an_overflowing_query_is_never_written_to_a_trace(self):
        model = self.model(TinyLlama().scale("blk.0.attn_norm.weight", 1e30).scale("blk.0.attn_q.weight", 1e10))
        self.assert_input_error(self.capture(model), self.text + " sequence 0, layer 0, position 0: non-finite query")

    # Class 4: files that are not regular files.

    def test_model_and_text_paths_that_are_not_regular_files(self):
        model = self.model(TinyLlama())
        folder = self.path("folder")
        os.mkdir(folder)
        fifo = self.path("fifo")
        os.mkfifo(fifo)
        long_name = self.path("x" * 300)
        for bad, why in ((folder, "is a directory"), (fifo, "is a FIFO"), (long_name, "cannot open (File name too long)"),
                         (self.path("absent"), "no such file")):
            with self.subTest(path=bad):
                self.assert_input_error(self.capture(bad), bad + ": " + why)
                self.assert_input_error(self.eval(bad), bad + ": " + why)
                self.assert_input_error(self.capture(model, text=bad), bad + ": " + why)
                self.assert_input_error(self.eval(model, text=bad), bad + ": " + why)

    # Class 5: the tokenizer.

    def test_tokenizer_scores_and_types_out_of_range(self):
        cases = [
            ("tokenizer.ggml.scores", lambda v: v.__setitem__(3, float("nan")), "entry 3"),
            ("tokenizer.ggml.scores", lambda v: v.__setitem__(7, float("-inf")), "entry 7"),
            ("tokenizer.ggml.token_type", lambda v: v.__setitem__(4, 99), "entry 4"),
            ("tokenizer.ggml.token_type", lambda v: v.__setitem__(0, -2147483648), "entry 0"),
        ]
        for key, poison, fragment in cases:
            with self.subTest(key=key, fragment=fragment):
                llama = TinyLlama()
                poison(llama.metadata[key][1][1])
                model = self.model(llama)
                self.assert_input_error(self.capture(model), model + ": metadata key '%s': %s" % (key, fragment))
        llama = TinyLlama()
        llama.metadata["tokenizer.ggml.token_type"] = (ARRAY, (FLOAT64, [1e300] * llama.vocab))
        model = self.model(llama)
        self.assert_input_error(self.capture(model), "'tokenizer.ggml.token_type': entry 0")
        model = self.model(TinyLlama().set("tokenizer.ggml.tokens", ARRAY, (STRING, [])))
        self.assert_input_error(self.capture(model), "'tokenizer.ggml.tokens': empty vocabulary")

    def test_random_bytes_as_text(self):
        rng = random.Random(7)
        text = self.path("noise.txt")
        models = [self.model(TinyLlama())]
        if os.path.exists(STORIES_MODEL):
            models.append(STORIES_MODEL)
        for trial in range(3):
            with open(text, "wb") as f:
                f.write(bytes(rng.randrange(256) for _ in range(3000)) + b"\xf0\x9f" + b"\xc3")
            for model in models:
                with self.subTest(trial=trial, model=model):
                    result = self.capture(model, "--max-tokens", "400", text=text)
                    self.assertEqual(result.returncode, 0, result.stderr)
                    result = self.eval(model, "--max-tokens", "200", text=text)
                    self.assertEqual(result.returncode, 0, result.stderr)


if __name__ == "__main__":
    cli_common.KVSIM = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
