// The HDF5 trace store: round trips, the reader's checks, and replay from a file.
#include <doctest/doctest.h>
#include <hdf5.h>

#include <Eigen/Core>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>

#include "helpers.h"
#include "hostile_traces.h"
#include "cache_math/numerics.h"
#include "sim/trace_store.h"
#include "base/errors.h"

using namespace kvsim;
using namespace kvsim::test;

namespace {

std::string input_error(const std::string& path) {
    try {
        TraceReader reader(path);
    } catch (const InputError& e) {
        return e.what();
    }
    return "";
}

TraceMetadata qkv_metadata() {
    TraceMetadata m = small_qkv_metadata("test");
    m.source_model_file = "m.gguf";
    m.source_model_sha256 = std::string(64, 'a');
    return m;
}

QkvLayer random_layer(int64_t tokens, const TraceMetadata& m, unsigned seed) {
    return random_qkv_layer(tokens, m, seed, 3.0f);
}

// IEEE binary16 as HDF5 describes it (as the trace writer and h5py store it).
hid_t hdf5_half_type() {
    const hid_t t = H5Tcopy(H5T_IEEE_F32LE);
    H5Tset_fields(t, 15, 10, 5, 0, 10);
    H5Tset_size(t, 2);
    H5Tset_ebias(t, 15);
    return t;
}

// A dataset read through HDF5's own conversion to float, as the reader read float16 before.
std::vector<float> read_through_hdf5(const std::string& path, const std::string& dataset, std::size_t count) {
    const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    const hid_t data = H5Dopen2(file, dataset.c_str(), H5P_DEFAULT);
    std::vector<float> out(count);
    REQUIRE(H5Dread(data, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()) >= 0);
    H5Dclose(data);
    H5Fclose(file);
    return out;
}

}  // namespace

TEST_CASE("float16 Q/K/V read as the same float bits HDF5's conversion gives: every finite half, subnormals, -0") {
    // Every finite half (+-0, subnormals, normals up to +-65504), in datasets whose sizes are not
    // multiples of 8, so the vector loop's tail is read too.
    std::vector<float> finite_halves;
    for (uint32_t h = 0; h < 0x10000u; ++h)
        if ((h & 0x7c00u) != 0x7c00u) finite_halves.push_back(half_bits_to_float(static_cast<uint16_t>(h)));
    TraceMetadata m = qkv_metadata();
    m.num_layers = 1;
    m.head_dim = 7;
    const int64_t tokens = 4547;  // K and V: 63,658 values, more than the 63,488 finite halves
    QkvLayer layer;
    layer.tokens = tokens;
    layer.q.resize(tokens * m.num_query_heads * m.head_dim);
    layer.k.resize(tokens * m.num_kv_heads * m.head_dim);
    layer.v.resize(layer.k.size());
    std::size_t next = 0;
    for (auto* tensor : {&layer.q, &layer.k, &layer.v})
        for (float& x : *tensor) x = finite_halves[next++ % finite_halves.size()];
    const std::string path = temp_dir() + "/every-half.h5";
    {
        TraceWriter writer(path, m);
        writer.write_qkv(writer.add_sequence("halves", tokens), 0, layer, TensorDtype::float16);
        writer.commit();
    }
    const QkvLayer read = TraceReader(path).read_qkv(0, 0);
    const std::pair<const char*, const std::vector<float>*> tensors[] = {
        {"q", &read.q}, {"k", &read.k}, {"v", &read.v}};
    const std::vector<float>* written[] = {&layer.q, &layer.k, &layer.v};
    for (int i = 0; i < 3; ++i) {
        const auto& name = tensors[i].first;  // not a structured binding: clang 14 cannot capture one
        const auto& values = tensors[i].second;
        INFO("tensor " << name);
        const std::vector<float> hdf5 =
            read_through_hdf5(path, std::string("/sequences/000000/qkv/layer_000/") + name, values->size());
        REQUIRE(values->size() == hdf5.size());
        CHECK(std::memcmp(values->data(), hdf5.data(), hdf5.size() * sizeof(float)) == 0);
        CHECK(std::memcmp(values->data(), written[i]->data(), hdf5.size() * sizeof(float)) == 0);
    }
}

TEST_CASE("cache_math's half conversion, the reader's fallback without F16C, is HDF5's on every half") {
    std::vector<uint16_t> halves(0x10000);
    for (uint32_t h = 0; h < 0x10000u; ++h) halves[h] = static_cast<uint16_t>(h);
    std::vector<float> converted(0x10000);
    std::memcpy(converted.data(), halves.data(), halves.size() * sizeof(uint16_t));  // converted in place
    const hid_t half = hdf5_half_type();
    REQUIRE(H5Tconvert(half, H5T_NATIVE_FLOAT, converted.size(), converted.data(), nullptr, H5P_DEFAULT) >= 0);
    H5Tclose(half);
    int mismatches = 0;
    for (uint32_t h = 0; h < 0x10000u; ++h) {
        const float ours = half_bits_to_float(halves[h]), theirs = converted[h];
        if (std::isnan(ours))  // NaN never reaches a replay (the reader refuses it): sign and NaN-ness
            mismatches += !std::isnan(theirs) || std::signbit(ours) != std::signbit(theirs);
        else
            mismatches += std::memcmp(&ours, &theirs, sizeof(float)) != 0;
    }
    CHECK(mismatches == 0);
}

TEST_CASE("a policybook trace written to HDF5 reads back bit for bit, and replays to the same results") {
    const std::string path = temp_dir() + "/decode-4096.h5";
    write_policybook_trace(PolicybookTraceSpec{}, path);
    TraceReader reader(path);
    CHECK(reader.metadata().kind == TraceKind::attention);
    CHECK(reader.metadata().source_generator == "policybook/decode-4096");
    CHECK(reader.metadata().source_seed == 7);
    REQUIRE(reader.sequences().size() == 1);
    CHECK(reader.sequences()[0].length == 4096);

    // Read back in uneven blocks: the hash must still be the reference's.
    Fnv1a32 hash;
    std::vector<float> rows;
    for (int64_t first = 1; first < 4096;) {
        const int64_t end = std::min<int64_t>(4096, first + 1 + first % 300);
        reader.read_attention_rows(0, 0, 0, first, end, rows);
        hash.add(rows);
        first = end;
    }
    CHECK(hash.value() == 0xBAEC2A10u);

    const std::vector<PolicyEntry> policies = {entry("streaming_llm"), entry("h2o"), entry("snapkv")};
    auto from_file = open_trace_source(path, 0);
    const auto file_rows = replay_rows(*from_file, policies, {256, 1024});
    const auto memory_rows = policybook_rows(policies, {256, 1024});
    REQUIRE(file_rows.size() == memory_rows.size());
    for (std::size_t i = 0; i < file_rows.size(); ++i) {
        CHECK(file_rows[i].retained_mass == memory_rows[i].retained_mass);
        CHECK(file_rows[i].recall == memory_rows[i].recall);
    }
    CHECK(find_row(file_rows, "streaming_llm", 256).retained_mass == 0.736691);
}

TEST_CASE("qkv layers round trip in float32 exactly and in float16 as correctly rounded halves") {
    const std::string path = temp_dir() + "/qkv.h5";
    const TraceMetadata m = qkv_metadata();
    const QkvLayer l0 = random_layer(300, m, 1), l1 = random_layer(300, m, 2);
    {
        TraceWriter writer(path, m);
        const int s = writer.add_sequence("story", 300);
        writer.write_qkv(s, 0, l0, TensorDtype::float32);
        writer.write_qkv(s, 1, l1, TensorDtype::float16);
        std::vector<int32_t> tokens(300);
        for (int i = 0; i < 300; ++i) tokens[i] = i * 7;
        writer.write_tokens(s, tokens);
        writer.commit();
    }
    TraceReader reader(path);
    CHECK(reader.metadata().num_kv_heads == 2);
    CHECK(reader.metadata().source_model_sha256 == std::string(64, 'a'));
    const QkvLayer r0 = reader.read_qkv(0, 0), r1 = reader.read_qkv(0, 1);
    CHECK(r0.q == l0.q);
    CHECK(r0.k == l0.k);
    CHECK(r0.v == l0.v);
    REQUIRE(r1.k.size() == l1.k.size());
    int mismatches = 0;
    for (std::size_t i = 0; i < l1.k.size(); ++i)
        mismatches += r1.k[i] != static_cast<float>(Eigen::half(l1.k[i]));
    CHECK(mismatches == 0);
    CHECK(r1.q[5] != l1.q[5]);  // float16 really lost precision
    CHECK(reader.read_tokens(0)[299] == 299 * 7);
    CHECK(input_error(path).empty());
}

namespace {

// How layer 0's Q of a test trace is stored instead of as the writer stores it.
struct QLayout {
    const char* what;
    bool half = false;          // IEEE half, else float32
    bool big_endian = false;    // float32 only
    std::vector<hsize_t> chunk;  // empty: contiguous
    std::vector<H5Z_filter_t> filters;  // in pipeline order
    bool from_chunks = false;   // read_qkv reads it from its stored chunks
};

// Replaces layer 0's Q of the trace at `path` by `values` stored as `layout` says.
void store_q(const std::string& path, const QLayout& layout, const std::vector<float>& values, const TraceMetadata& m,
             hsize_t tokens) {
    const std::string name = "/sequences/000000/qkv/layer_000/q";
    const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    REQUIRE(H5Ldelete(file, name.c_str(), H5P_DEFAULT) >= 0);
    const hsize_t dims[3] = {tokens, static_cast<hsize_t>(m.num_query_heads), static_cast<hsize_t>(m.head_dim)};
    const hid_t space = H5Screate_simple(3, dims, nullptr);
    const hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    if (!layout.chunk.empty()) H5Pset_chunk(dcpl, 3, layout.chunk.data());
    for (H5Z_filter_t filter : layout.filters) {
        if (filter == H5Z_FILTER_SHUFFLE) H5Pset_shuffle(dcpl);
        if (filter == H5Z_FILTER_DEFLATE) H5Pset_deflate(dcpl, 6);
        if (filter == H5Z_FILTER_FLETCHER32) H5Pset_fletcher32(dcpl);
    }
    const hid_t type = layout.half ? hdf5_half_type() : H5Tcopy(layout.big_endian ? H5T_IEEE_F32BE : H5T_IEEE_F32LE);
    const hid_t dataset = H5Dcreate2(file, name.c_str(), type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    REQUIRE(dataset >= 0);
    REQUIRE(H5Dwrite(dataset, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) >= 0);
    H5Dclose(dataset);
    H5Tclose(type);
    H5Pclose(dcpl);
    H5Sclose(space);
    H5Fclose(file);
}

// What reading layer 0 of the trace at `path` throws, or "".
std::string layer_error(const std::string& path) {
    try {
        TraceReader(path).read_qkv(0, 0);
    } catch (const InputError& e) {
        return e.what();
    }
    return "";
}

}  // namespace

TEST_CASE("Q/K/V stored in any layout HDF5 reads come back as HDF5 reads them; kvsim's own from their chunks") {
    const TraceMetadata m = qkv_metadata();
    constexpr int64_t tokens = 300;  // not a multiple of any chunk below: edge chunks are read too
    const QkvLayer layer = random_layer(tokens, m, 5);
    const std::string q = "/sequences/000000/qkv/layer_000/q";
    for (TensorDtype dtype : {TensorDtype::float32, TensorDtype::float16}) {
        // As the writer stores Q/K/V: chunks of 256 whole rows, shuffled and deflated.
        const std::string path = temp_dir() + "/layouts.h5";
        {
            TraceWriter writer(path, m);
            writer.write_qkv(writer.add_sequence("story", tokens), 0, layer, dtype);
            writer.write_qkv(0, 1, layer, dtype);
            writer.commit();
        }
        TraceReader reader(path);
        const QkvLayer read = reader.read_qkv(0, 0);
        CHECK(reader.datasets_read_from_chunks() == 3);
        CHECK(std::memcmp(read.q.data(), read_through_hdf5(path, q, read.q.size()).data(), read.q.size() * 4) == 0);
        if (dtype == TensorDtype::float32) CHECK(read.q == layer.q);
    }
    // Rows of 4 x 5 values: chunks whose sizes are not multiples of the vector loops' widths, so
    // that the value past the last whole vector is checked by the loops' tails.
    for (TensorDtype dtype : {TensorDtype::float32, TensorDtype::float16}) {
        TraceMetadata narrow = m;
        narrow.head_dim = 5;
        QkvLayer bad = random_layer(tokens, narrow, 6);
        const std::size_t last = bad.q.size() - 1;
        bad.q[last] = std::numeric_limits<float>::quiet_NaN();
        const std::string path = temp_dir() + "/narrow.h5";
        {
            TraceWriter writer(path, narrow);
            writer.write_qkv(writer.add_sequence("story", tokens), 0, bad, dtype);
            writer.write_qkv(0, 1, random_layer(tokens, narrow, 7), dtype);
            writer.commit();
        }
        CHECK(layer_error(path).find("dataset '" + q + "': element " + std::to_string(last) + " (") != std::string::npos);
    }
    const hsize_t hq = m.num_query_heads, d = m.head_dim;
    const QLayout layouts[] = {
        {"as kvsim writes them", false, false, {256, hq, d}, {H5Z_FILTER_SHUFFLE, H5Z_FILTER_DEFLATE}, true},
        {"as kvsim writes them, half", true, false, {256, hq, d}, {H5Z_FILTER_SHUFFLE, H5Z_FILTER_DEFLATE}, true},
        {"contiguous", false, false, {}, {}, false},
        {"contiguous, half", true, false, {}, {}, false},
        {"deflated", false, false, {64, hq, d}, {H5Z_FILTER_DEFLATE}, true},
        {"unfiltered chunks", false, false, {64, hq, d}, {}, true},
        {"unfiltered chunks, half", true, false, {64, hq, d}, {}, true},
        {"shuffled only", false, false, {64, hq, d}, {H5Z_FILTER_SHUFFLE}, true},
        {"shuffled and deflated, half, one-token chunks", true, false, {1, hq, d}, {H5Z_FILTER_SHUFFLE, H5Z_FILTER_DEFLATE}, true},
        {"deflated, then shuffled", false, false, {64, hq, d}, {H5Z_FILTER_DEFLATE, H5Z_FILTER_SHUFFLE}, false},
        {"with a checksum", false, false, {64, hq, d}, {H5Z_FILTER_SHUFFLE, H5Z_FILTER_DEFLATE, H5Z_FILTER_FLETCHER32}, false},
        {"chunks of part of a row", false, false, {16, 1, d}, {H5Z_FILTER_SHUFFLE, H5Z_FILTER_DEFLATE}, false},
        {"big-endian", false, true, {64, hq, d}, {H5Z_FILTER_SHUFFLE, H5Z_FILTER_DEFLATE}, false},
    };
    for (const QLayout& layout : layouts) {
        const std::string what = layout.what;
        CAPTURE(what);
        const std::string path = temp_dir() + "/layout.h5";
        {
            TraceWriter writer(path, m);
            writer.write_qkv(writer.add_sequence("story", tokens), 0, layer, TensorDtype::float32);
            writer.write_qkv(0, 1, layer, TensorDtype::float32);
            writer.commit();
        }
        store_q(path, layout, layer.q, m, tokens);
        {
            TraceReader reader(path);
            const QkvLayer read = reader.read_qkv(0, 0);
            CHECK(reader.datasets_read_from_chunks() == 2 + layout.from_chunks);  // K and V as written
            const std::vector<float> hdf5 = read_through_hdf5(path, q, read.q.size());
            CHECK(std::memcmp(read.q.data(), hdf5.data(), hdf5.size() * 4) == 0);
            if (!layout.half) CHECK(read.q == layer.q);
        }
        // One value that is not finite, in a vector loop's reach, in the middle, and in the last
        // chunk's tail: the same one line naming the element, whichever path read it.
        const std::size_t n = layer.q.size();
        const std::pair<std::size_t, float> bad_values[] = {{5, std::numeric_limits<float>::quiet_NaN()},
                                                            {n / 2 + 3, -std::numeric_limits<float>::infinity()},
                                                            {n - 1, std::numeric_limits<float>::infinity()}};
        for (const auto& bad : bad_values) {
            const std::size_t at = bad.first;  // not a structured binding: clang 14 cannot capture one
            const float value = bad.second;
            CAPTURE(at);
            std::vector<float> values = layer.q;
            values[at] = value;
            store_q(path, layout, values, m, tokens);
            CHECK(layer_error(path).find("dataset '" + q + "': element " + std::to_string(at) + " (") != std::string::npos);
        }
    }
}

TEST_CASE("the reader rejects missing, foreign, truncated and wrong-version files with the file named") {
    const std::string dir = temp_dir();
    CHECK(input_error(dir + "/nope.h5").find("nope.h5: no such file") != std::string::npos);

    const std::string text = dir + "/text.h5";
    std::ofstream(text) << "not hdf5\n";
    CHECK(input_error(text).find("not an HDF5 file") != std::string::npos);

    // A valid HDF5 file that is not a kvsim trace.
    const std::string foreign = dir + "/foreign.h5";
    H5Fclose(H5Fcreate(foreign.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
    CHECK(input_error(foreign).find("not a kvsim trace") != std::string::npos);

    // Truncated: cut a real trace in half.
    const std::string good = dir + "/good.h5", cut = dir + "/cut.h5";
    {
        TraceWriter writer(good, qkv_metadata());
        writer.add_sequence("s", 64);
        writer.write_qkv(0, 0, random_layer(64, qkv_metadata(), 3), TensorDtype::float32);
        writer.write_qkv(0, 1, random_layer(64, qkv_metadata(), 4), TensorDtype::float32);
        writer.commit();
    }
    std::filesystem::copy_file(good, cut, std::filesystem::copy_options::overwrite_existing);
    std::filesystem::resize_file(cut, std::filesystem::file_size(good) / 2);
    const std::string truncated = input_error(cut);
    CHECK(truncated.find("cut.h5") != std::string::npos);
    CHECK(!truncated.empty());

    // Wrong schema version.
    const std::string v2 = dir + "/v2.h5";
    std::filesystem::copy_file(good, v2, std::filesystem::copy_options::overwrite_existing);
    {
        hid_t f = H5Fopen(v2.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
        hid_t a = H5Aopen(f, "format_version", H5P_DEFAULT);
        const int64_t two = 2;
        H5Awrite(a, H5T_NATIVE_INT64, &two);
        H5Aclose(a);
        H5Fclose(f);
    }
    CHECK(input_error(v2).find("'format_version' is 2") != std::string::npos);

    // A dataset with the wrong shape is named.
    const std::string bad_shape = dir + "/shape.h5";
    std::filesystem::copy_file(good, bad_shape, std::filesystem::copy_options::overwrite_existing);
    {
        hid_t f = H5Fopen(bad_shape.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
        hid_t a = H5Aopen(f, "num_kv_heads", H5P_DEFAULT);
        const int64_t four = 4;
        H5Awrite(a, H5T_NATIVE_INT64, &four);
        H5Aclose(a);
        H5Fclose(f);
    }
    const std::string shape_error = input_error(bad_shape);
    CHECK(shape_error.find("/sequences/000000/qkv/layer_000/k") != std::string::npos);
    CHECK(shape_error.find("expected [64, 4, 8]") != std::string::npos);
}

TEST_CASE("a trace writer that is not committed leaves no file behind") {
    const std::string path = temp_dir() + "/abandoned.h5";
    std::filesystem::remove(path);
    {
        TraceWriter writer(path, qkv_metadata());
        writer.add_sequence("s", 10);
    }
    CHECK(!std::filesystem::exists(path));
    for (const auto& f : std::filesystem::directory_iterator(temp_dir()))
        CHECK(f.path().filename().string().find("abandoned.h5.tmp") == std::string::npos);
}
