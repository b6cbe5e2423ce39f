#include "hostile_traces.h"

#include <hdf5.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "sim/trace_store.h"

namespace kvsim::test {

TraceMetadata small_qkv_metadata(const std::string& model_name) {
    TraceMetadata m;
    m.kind = TraceKind::qkv;
    m.model_name = model_name;
    m.num_layers = 2;
    m.num_query_heads = 4;
    m.num_kv_heads = 2;
    m.head_dim = 8;
    m.source_kind = "model";
    return m;
}

QkvLayer random_qkv_layer(int64_t tokens, const TraceMetadata& m, unsigned seed, float sigma) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, sigma);
    QkvLayer layer;
    layer.tokens = tokens;
    layer.q.resize(tokens * m.num_query_heads * m.head_dim);
    layer.k.resize(tokens * m.num_kv_heads * m.head_dim);
    layer.v.resize(tokens * m.num_kv_heads * m.head_dim);
    for (auto* v : {&layer.q, &layer.k, &layer.v})
        for (float& x : *v) x = normal(rng);
    return layer;
}

namespace {

TraceMetadata attention_metadata() {
    TraceMetadata m;
    m.kind = TraceKind::attention;
    m.model_name = "hostile";
    m.source_kind = "synthetic";
    return m;
}

// Rows 1..length-1 packed, every weight 1 / (t + 1).
std::vector<float> uniform_rows(int64_t first, int64_t end) {
    std::vector<float> rows;
    for (int64_t t = first; t < end; ++t) rows.insert(rows.end(), t, 1.0f / static_cast<float>(t + 1));
    return rows;
}

void write_qkv(const std::string& path, QkvLayer l0, QkvLayer l1, TensorDtype dtype = TensorDtype::float32) {
    TraceWriter writer(path, small_qkv_metadata("hostile"));
    const int s = writer.add_sequence("story", kHostileQkvTokens);
    writer.write_qkv(s, 0, l0, dtype);
    writer.write_qkv(s, 1, l1, dtype);
    writer.commit();
}

void write_attention(const std::string& path, int64_t length, const std::vector<float>& rows) {
    TraceWriter writer(path, attention_metadata());
    const int s = writer.add_sequence("rows", length);
    writer.write_attention_rows(s, 0, 0, 1, rows);
    writer.commit();
}

void set_int_attr(const std::string& path, const char* object, const char* name, int64_t value) {
    // Through the object: HDF5 1.10 cannot write an attribute H5Aopen_by_name opened on a path.
    const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    const hid_t o = H5Oopen(f, object, H5P_DEFAULT);
    const hid_t a = H5Aopen(o, name, H5P_DEFAULT);
    if (H5Awrite(a, H5T_NATIVE_INT64, &value) < 0) throw std::runtime_error(path + ": cannot set " + name);
    H5Aclose(a);
    H5Oclose(o);
    H5Fclose(f);
}

// Replaces dataset `name` by a float32 one of `dims`, chunked by `chunk`, writing only
// `written` leading rows of zeros (none when 0).
void replace_dataset(hid_t f, const std::string& name, std::vector<hsize_t> dims, std::vector<hsize_t> chunk,
                     hsize_t written) {
    H5Ldelete(f, name.c_str(), H5P_DEFAULT);
    const hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
    const hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_chunk(dcpl, static_cast<int>(chunk.size()), chunk.data());
    H5Pset_deflate(dcpl, 1);
    const hid_t d = H5Dcreate2(f, name.c_str(), H5T_IEEE_F32LE, space, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    if (written > 0) {
        std::vector<hsize_t> start(dims.size(), 0), count = dims;
        count[0] = written;
        hsize_t n = 1;
        for (hsize_t c : count) n *= c;
        std::vector<float> zeros(n, 0.0f);
        H5Sselect_hyperslab(space, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
        const hid_t mem = H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr);
        H5Dwrite(d, H5T_NATIVE_FLOAT, mem, space, H5P_DEFAULT, zeros.data());
        H5Sclose(mem);
    }
    H5Dclose(d);
    H5Pclose(dcpl);
    H5Sclose(space);
}

}  // namespace

std::vector<std::string> hostile_trace_kinds() {
    return {"valid-qkv",         "valid-attention",    "qkv-nan",          "qkv-inf",
            "qkv-fp16-nan",      "qkv-overflow",       "attention-nan",    "attention-above-one",
            "attention-negative", "attention-row-sum", "length-2e31",      "attention-unstored",
            "qkv-unstored",      "big-chunk",          "num-layers-2e32",  "string-array",
            "external-link",     "qkv-corrupt-chunk",  "qkv-beyond-fp16",    "qkv-beyond-fp16-stored-fp16", "rope-short",
            "rope-negative",     "rope-half",          "pre-rope-keys-missing"};
}

void write_hostile_trace(const std::string& kind, const std::string& path) {
    const TraceMetadata m = small_qkv_metadata("hostile");
    const int64_t T = kHostileAttentionTokens;
    if (kind == "valid-qkv") {
        write_qkv(path, random_qkv_layer(kHostileQkvTokens, m, 1), random_qkv_layer(kHostileQkvTokens, m, 2));
    } else if (kind == "qkv-nan") {
        QkvLayer l1 = random_qkv_layer(kHostileQkvTokens, m, 2);
        l1.k[1000] = std::numeric_limits<float>::quiet_NaN();
        write_qkv(path, random_qkv_layer(kHostileQkvTokens, m, 1), l1);
    } else if (kind == "qkv-inf") {
        QkvLayer l0 = random_qkv_layer(kHostileQkvTokens, m, 1);
        l0.q[77] = std::numeric_limits<float>::infinity();
        write_qkv(path, l0, random_qkv_layer(kHostileQkvTokens, m, 2));
    } else if (kind == "qkv-fp16-nan") {
        QkvLayer l0 = random_qkv_layer(kHostileQkvTokens, m, 1);
        l0.v[500] = std::numeric_limits<float>::quiet_NaN();
        write_qkv(path, l0, random_qkv_layer(kHostileQkvTokens, m, 2), TensorDtype::float16);
    } else if (kind == "qkv-overflow") {
        // Query head 3 reads KV head 1. Its query at token 5 and KV head 1's key at token 2 are
        // 1e20 in every channel: finite, but their product is 8e40 / sqrt(8), past float32.
        QkvLayer l1 = random_qkv_layer(kHostileQkvTokens, m, 2);
        for (int c = 0; c < 8; ++c) {
            l1.q[(5 * 4 + 3) * 8 + c] = 1e20f;
            l1.k[(2 * 2 + 1) * 8 + c] = 1e20f;
        }
        write_qkv(path, random_qkv_layer(kHostileQkvTokens, m, 1), l1);
    } else if (kind == "qkv-beyond-fp16" || kind == "qkv-beyond-fp16-stored-fp16") {
        // Finite float32 values past float16's largest (65504): a key and a value of layer 0.
        // As float32 they are valid; stored as float16 they would be Inf (the writer refuses).
        QkvLayer l0 = random_qkv_layer(kHostileQkvTokens, m, 1);
        l0.k[(3 * 2 + 0) * 8 + 2] = 1e5f;
        l0.v[(4 * 2 + 1) * 8 + 5] = -2e6f;
        write_qkv(path, l0, random_qkv_layer(kHostileQkvTokens, m, 2),
                  kind == "qkv-beyond-fp16" ? TensorDtype::float32 : TensorDtype::float16);
    } else if (kind == "valid-attention") {
        write_attention(path, T, uniform_rows(1, T));
    } else if (kind == "attention-nan" || kind == "attention-above-one" || kind == "attention-negative") {
        std::vector<float> rows = uniform_rows(1, T);
        const int64_t step = kind == "attention-nan" ? 10 : 20, position = kind == "attention-nan" ? 3 : 7;
        rows[attention_row_offset(step) - attention_row_offset(1) + position] =
            kind == "attention-nan" ? std::numeric_limits<float>::quiet_NaN()
            : kind == "attention-above-one" ? 1.5f
                                            : -0.25f;
        write_attention(path, T, rows);
    } else if (kind == "attention-row-sum") {
        std::vector<float> rows = uniform_rows(1, T);
        for (int64_t j = 0; j < 30; ++j) rows[attention_row_offset(30) - attention_row_offset(1) + j] = 0.05f;
        write_attention(path, T, rows);
    } else if (kind == "length-2e31") {
        write_attention(path, int64_t{1} << 31, uniform_rows(1, 64));
    } else if (kind == "attention-unstored") {
        write_attention(path, int64_t{1} << 20, uniform_rows(1, 64));
    } else if (kind == "qkv-unstored") {
        write_qkv(path, random_qkv_layer(kHostileQkvTokens, m, 1), random_qkv_layer(kHostileQkvTokens, m, 2));
        const hsize_t t = hsize_t{1} << 24;
        set_int_attr(path, "/sequences/000000", "length", static_cast<int64_t>(t));
        const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
        for (const char* layer : {"layer_000", "layer_001"})
            for (const char* tensor : {"q", "k", "v"}) {
                const hsize_t heads = tensor[0] == 'q' ? 4 : 2;
                replace_dataset(f, std::string("/sequences/000000/qkv/") + layer + "/" + tensor, {t, heads, 8},
                                {256, heads, 8}, 0);
            }
        H5Fclose(f);
    } else if (kind == "big-chunk") {
        // Every weight 0 (each token's own weight 1): valid, but one chunk of 4096 * 4095 / 2
        // floats, which a reader inflates whole.
        write_attention(path, 4096, uniform_rows(1, 2));
        const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
        const hsize_t n = static_cast<hsize_t>(attention_row_offset(4096));
        replace_dataset(f, "/sequences/000000/attention/layer_000/head_000", {n}, {n}, n);
        H5Fclose(f);
    } else if (kind == "qkv-corrupt-chunk") {
        // Layer 1's K: its first chunk's compressed bytes overwritten, so that inflating it fails.
        // The replay loads layer 1 beside layer 0's, on whichever thread takes the task.
        write_qkv(path, random_qkv_layer(kHostileQkvTokens, m, 1), random_qkv_layer(kHostileQkvTokens, m, 2));
        const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
        const hid_t d = H5Dopen2(f, "/sequences/000000/qkv/layer_001/k", H5P_DEFAULT);
        hsize_t origin[3];
        unsigned filter_mask = 0;
        haddr_t address = 0;
        hsize_t bytes = 0;
        const hid_t space = H5Dget_space(d);
        const herr_t found = H5Dget_chunk_info(d, space, 0, origin, &filter_mask, &address, &bytes);
        H5Sclose(space);
        H5Dclose(d);
        H5Fclose(f);
        if (found < 0 || bytes == 0) throw std::runtime_error("qkv-corrupt-chunk: no chunk to corrupt");
        std::FILE* file = std::fopen(path.c_str(), "r+b");
        const std::vector<unsigned char> junk(bytes, 0xA5);
        if (!file || std::fseek(file, static_cast<long>(address), SEEK_SET) != 0 ||
            std::fwrite(junk.data(), 1, junk.size(), file) != junk.size())
            throw std::runtime_error("qkv-corrupt-chunk: cannot overwrite the chunk");
        std::fclose(file);
    } else if (kind == "num-layers-2e32") {
        write_qkv(path, random_qkv_layer(kHostileQkvTokens, m, 1), random_qkv_layer(kHostileQkvTokens, m, 2));
        set_int_attr(path, "/", "num_layers", (int64_t{1} << 32) + 1);
    } else if (kind == "external-link") {
        // Layer 1's K is a link to a dataset in another file (here the trace itself, by name).
        write_qkv(path, random_qkv_layer(kHostileQkvTokens, m, 1), random_qkv_layer(kHostileQkvTokens, m, 2));
        const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
        H5Ldelete(f, "/sequences/000000/qkv/layer_001/k", H5P_DEFAULT);
        H5Lcreate_external(path.c_str(), "/sequences/000000/qkv/layer_000/k", f, "/sequences/000000/qkv/layer_001/k",
                           H5P_DEFAULT, H5P_DEFAULT);
        H5Fclose(f);
    } else if (kind == "string-array") {
        write_qkv(path, random_qkv_layer(kHostileQkvTokens, m, 1), random_qkv_layer(kHostileQkvTokens, m, 2));
        const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
        H5Adelete(f, "model_name");
        const hid_t type = H5Tcopy(H5T_C_S1);
        H5Tset_size(type, 8);
        const hsize_t three = 3;
        const hid_t space = H5Screate_simple(1, &three, nullptr);
        const hid_t a = H5Acreate2(f, "model_name", type, space, H5P_DEFAULT, H5P_DEFAULT);
        const char text[24] = "aaaaaaabbbbbbbbcccccccc";
        H5Awrite(a, type, text);
        H5Aclose(a);
        H5Sclose(space);
        H5Tclose(type);
        H5Fclose(f);
    } else if (kind == "rope-short" || kind == "rope-negative" || kind == "rope-half" ||
               kind == "pre-rope-keys-missing") {
        // The recorded RoPE: 3 frequencies for head size 8, a negative one, a pairing without
        // frequencies, or keys before RoPE claimed but not stored.
        write_qkv(path, random_qkv_layer(kHostileQkvTokens, m, 1), random_qkv_layer(kHostileQkvTokens, m, 2));
        const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
        auto add_string = [&](const char* name, const char* value) {
            const hid_t type = H5Tcopy(H5T_C_S1);
            H5Tset_size(type, std::strlen(value));
            const hid_t space = H5Screate(H5S_SCALAR);
            const hid_t a = H5Acreate2(f, name, type, space, H5P_DEFAULT, H5P_DEFAULT);
            H5Awrite(a, type, value);
            H5Aclose(a), H5Sclose(space), H5Tclose(type);
        };
        auto add_doubles = [&](const std::vector<double>& values) {
            const hsize_t n = values.size();
            const hid_t space = H5Screate_simple(1, &n, nullptr);
            const hid_t a = H5Acreate2(f, "rope_frequencies", H5T_IEEE_F64LE, space, H5P_DEFAULT, H5P_DEFAULT);
            H5Awrite(a, H5T_NATIVE_DOUBLE, values.data());
            H5Aclose(a), H5Sclose(space);
        };
        add_string("rope_pairing", "adjacent");
        if (kind == "rope-short") add_doubles({1.0, 0.1, 0.01});
        if (kind == "rope-negative") add_doubles({1.0, 0.1, -0.01, 0.001});
        if (kind == "pre-rope-keys-missing") {
            add_doubles({1.0, 0.1, 0.01, 0.001});
            const int64_t one = 1;
            const hid_t space = H5Screate(H5S_SCALAR);
            const hid_t a = H5Acreate2(f, "pre_rope_keys", H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT);
            H5Awrite(a, H5T_NATIVE_INT64, &one);
            H5Aclose(a), H5Sclose(space);
        }
        H5Fclose(f);
    } else {
        throw std::invalid_argument("unknown hostile trace kind '" + kind + "'");
    }
}

}  // namespace kvsim::test
