// Low-rank K/V latents and KV-head grouping: the PCA against a closed form, exactness at full rank
// and for identical heads, memory arithmetic, composition, and bad input.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numbers>
#include <unistd.h>

#include "helpers.h"
#include "base/errors.h"
#include "base/hdf5_file.h"
#include "base/input_file.h"
#include "sim/attention_source.h"
#include "cache_math/lowrank.h"
#include "sim/lowrank_fit.h"
#include "cache_math/tiers.h"
#include "sim/synthetic_qkv.h"
#include "src/config.h"
#include "src/experiment.h"

using namespace kvsim;
using namespace kvsim::test;

namespace {

std::string scratch(const std::string& name) {
    return temp_dir() + "/lowrank-" + std::to_string(::getpid()) + "-" + name;
}

// The tiny synthetic Q/K/V trace as a file (bases are fitted from files) and its bases.
struct TinyTrace {
    std::string trace = scratch("tiny.h5"), bases = scratch("tiny-bases.json");
    TinyTrace() {
        write_synthetic_qkv_trace(synthetic_qkv_trace("tiny-256", "test"), trace, TensorDtype::float32);
        write_kv_bases(bases, fit_kv_bases(trace, {}));
    }
    ~TinyTrace() {
        std::filesystem::remove(trace);
        std::filesystem::remove(bases);
    }
};

ExperimentConfig config_on(const std::string& trace, std::vector<PolicyEntry> policies) {
    ExperimentConfig config;
    config.file = "cfg.yaml";
    config.trace.path = trace;
    config.budgets = {64};
    config.policies = std::move(policies);
    config.metrics = {"output_rel_error", "bytes_per_token", "compression_ratio"};
    return config;
}

PolicyEntry lowrank(const std::string& bases, int key_rank, int value_rank, int joint = 0) {
    PolicyEntry e = entry("lowrank", {{"key_rank", key_rank}, {"value_rank", value_rank}, {"joint", joint}});
    e.files["bases"] = bases;
    return e;
}

// A row's label: the parameters that differ from their defaults, then the files by name.
std::string with_bases(const std::string& label, const std::string& bases) {
    const std::string file = "bases=" + std::filesystem::path(bases).filename().string();
    return label.back() == ')' ? label.substr(0, label.size() - 1) + "," + file + ")" : label + "(" + file + ")";
}

const ResultRecord& record(const std::vector<ResultRecord>& records, const std::string& label) {
    for (const ResultRecord& r : records)
        if (r.label == label && r.layer < 0) return r;
    throw std::runtime_error("no record " + label);
}

}  // namespace

TEST_CASE("PCA of points on a rotated ellipse: the closed-form axes and energies") {
    // x_t = R(theta) (s1 cos phi_t, s2 sin phi_t), phi_t = 2 pi t / n: the mean of x x^T is
    // R diag(s1^2 / 2, s2^2 / 2) R^T exactly, so the principal directions are R's columns.
    const double theta = 0.7, s1 = 3.0, s2 = 1.25;
    const int n = 360;
    QkvLayer layer;
    layer.tokens = n;
    for (int t = 0; t < n; ++t) {
        const double phi = 2 * std::numbers::pi * t / n;
        const double a = s1 * std::cos(phi), b = s2 * std::sin(phi);
        const float x = static_cast<float>(std::cos(theta) * a - std::sin(theta) * b);
        const float y = static_cast<float>(std::sin(theta) * a + std::cos(theta) * b);
        layer.k.insert(layer.k.end(), {x, y});
        layer.v.insert(layer.v.end(), {y, x});  // values: the mirror image
    }
    KvBasesFitter fitter(1, 1, 2);
    fitter.add(0, layer);
    const KvBases bases = fitter.finish({0});
    const PcaBasis& key = bases.key[0];
    CHECK(key.energy[0] == doctest::Approx(s1 * s1 / 2).epsilon(1e-6));
    CHECK(key.energy[1] == doctest::Approx(s2 * s2 / 2).epsilon(1e-6));
    // The sign of an eigenvector is fixed by its largest component being positive.
    CHECK(key.vectors(0, 0) == doctest::Approx(std::cos(theta)).epsilon(1e-6));
    CHECK(key.vectors(1, 0) == doctest::Approx(std::sin(theta)).epsilon(1e-6));
    CHECK(std::abs(key.vectors(0, 1)) == doctest::Approx(std::sin(theta)).epsilon(1e-6));
    CHECK(std::abs(key.vectors(1, 1)) == doctest::Approx(std::cos(theta)).epsilon(1e-6));
    const PcaBasis& value = bases.value[0];
    CHECK(value.vectors(0, 0) == doctest::Approx(std::sin(theta)).epsilon(1e-6));
    CHECK(value.vectors(1, 0) == doctest::Approx(std::cos(theta)).epsilon(1e-6));
    // One head: the joint basis is the head's own.
    CHECK(bases.joint_key[0].energy[0] == doctest::Approx(s1 * s1 / 2).epsilon(1e-6));
    CHECK(std::abs(key.mean[0]) < 1e-9);

    // Shifted by a constant: the same axes and energies about the mean, which is the shift.
    for (int t = 0; t < n; ++t) layer.k[2 * t] += 5.0f, layer.k[2 * t + 1] -= 2.0f;
    KvBasesFitter shifted(1, 1, 2);
    shifted.add(0, layer);
    const PcaBasis moved = shifted.finish({0}).key[0];
    CHECK(moved.mean[0] == doctest::Approx(5.0).epsilon(1e-6));
    CHECK(moved.mean[1] == doctest::Approx(-2.0).epsilon(1e-6));
    CHECK(moved.energy[0] == doctest::Approx(s1 * s1 / 2).epsilon(1e-5));
    CHECK(moved.energy[1] == doctest::Approx(s2 * s2 / 2).epsilon(1e-5));
    CHECK(moved.vectors(0, 0) == doctest::Approx(std::cos(theta)).epsilon(1e-5));
}

TEST_CASE("projection at full rank reconstructs within float rounding; rank 1 keeps the main axis") {
    TinyTrace tiny;
    auto bases = load_kv_bases(tiny.bases, 3, 2, 16);
    const QkvLayer layer = generate_synthetic_qkv_layer(synthetic_qkv_trace("tiny-256", "test"), 1);
    KvProjection p;
    p.bases = bases;
    p.key_rank.assign(6, 16);
    p.value_rank.assign(6, 16);
    std::vector<float> kl, vl, k, v;
    project_layer(p, 1, layer, 2, 16, kl, vl);
    reconstruct_layer(p, 1, layer.tokens, 2, 16, kl, vl, k, v);
    double err = 0, norm = 0;
    for (std::size_t i = 0; i < k.size(); ++i) err += std::pow(k[i] - layer.k[i], 2), norm += std::pow(layer.k[i], 2);
    // An orthonormal basis in doubles, values in floats: a few float ulps per component.
    CHECK(std::sqrt(err / norm) < 1e-6);
    // Fewer dimensions lose energy, less at higher rank (the bases were fitted on this trace).
    double previous = 0;
    for (int rank : {12, 8, 4, 1}) {
        p.key_rank.assign(6, rank);
        project_layer(p, 1, layer, 2, 16, kl, vl);
        reconstruct_layer(p, 1, layer.tokens, 2, 16, kl, vl, k, v);
        double e = 0;
        for (std::size_t i = 0; i < k.size(); ++i) e += std::pow(k[i] - layer.k[i], 2);
        CHECK(e > previous);
        previous = e;
    }
}

TEST_CASE("pre-RoPE keys: reconstruction at full rank followed by RoPE gives the recorded keys") {
    // tiny-256 applies RoPE with base 10000 to its keys, as the Llama forward pass does.
    TinyTrace tiny;
    const std::string pre = scratch("pre-rope.json");
    // The synthetic trace records the RoPE it applied; no base needs to be given.
    write_kv_bases(pre, fit_kv_bases(tiny.trace, {}, KeyFrame{true, 0}));
    auto bases = load_kv_bases(pre, 3, 2, 16);
    CHECK(bases->keys == "pre_rope");
    REQUIRE(bases->rope.frequencies.size() == 8);
    CHECK(bases->rope.pairing == RopePairing::adjacent);
    for (int i = 0; i < 8; ++i) CHECK(bases->rope.frequencies[i] == doctest::Approx(std::pow(10000.0, -i / 8.0)).epsilon(1e-12));
    // A base given for it must agree with what it records.
    const std::string given = scratch("pre-rope-given.json");
    write_kv_bases(given, fit_kv_bases(tiny.trace, {}, KeyFrame{true, 10000}));
    CHECK_THROWS_WITH_AS(fit_kv_bases(tiny.trace, {}, KeyFrame{true, 500000}),
                         doctest::Contains("does not describe it: leave rope_theta out"), InputError);
    const QkvLayer layer = generate_synthetic_qkv_layer(synthetic_qkv_trace("tiny-256", "test"), 2);
    // Rotating back and forth is the identity up to float rounding.
    std::vector<float> keys = layer.k;
    apply_rope_rows(keys.data(), 0, layer.tokens, 2, 16, bases->rope, true);
    apply_rope_rows(keys.data(), 0, layer.tokens, 2, 16, bases->rope, false);
    double err = 0, norm = 0;
    for (std::size_t i = 0; i < keys.size(); ++i) err += std::pow(keys[i] - layer.k[i], 2), norm += std::pow(layer.k[i], 2);
    CHECK(std::sqrt(err / norm) < 1e-6);
    // Projected on the pre-RoPE bases at full rank, reconstructed, rotated at each token's position.
    KvProjection p;
    p.bases = bases;
    p.key_rank.assign(6, 16);
    p.value_rank.assign(6, 16);
    std::vector<float> kl, vl, k, v;
    project_layer(p, 2, layer, 2, 16, kl, vl);
    reconstruct_layer(p, 2, layer.tokens, 2, 16, kl, vl, k, v);
    err = 0;
    for (std::size_t i = 0; i < k.size(); ++i) err += std::pow(k[i] - layer.k[i], 2);
    CHECK(std::sqrt(err / norm) < 1e-5);  // two rotations and a basis change in float
    // Token by token (as kvsim eval builds the cache) agrees with the whole layer at once.
    p.key_rank.assign(6, 5);
    project_layer(p, 2, layer, 2, 16, kl, vl);
    reconstruct_layer(p, 2, layer.tokens, 2, 16, kl, vl, k, v);
    std::vector<float> one(32), latent(32), back(32);
    for (int64_t t : {int64_t{0}, int64_t{17}, int64_t{255}}) {
        project_tokens(p, 2, 2, 16, true, layer.k.data() + t * 32, latent.data(), 1, t);
        reconstruct_tokens(p, 2, 2, 16, true, latent.data(), nullptr, back.data(), 1, t);
        for (int i = 0; i < 32; ++i) CHECK(back[i] == k[t * 32 + i]);
    }
    // In the replay: exact at full rank, and an error below full rank.
    PolicyEntry exact = lowrank(pre, 16, 16), low = lowrank(pre, 5, 16);
    const auto records = run_experiment(config_on(tiny.trace, {exact, low}), {}, false).records;
    CHECK(record(records, with_bases("lowrank(key_rank=16,value_rank=16)", pre)).output_rel_error == 0.0);
    CHECK(record(records, with_bases("lowrank(key_rank=5,value_rank=16)", pre)).output_rel_error > 0);
    std::filesystem::remove(pre);
}

TEST_CASE("lowrank in the replay: rank = head size errs by exactly 0; bytes follow the ranks and bases") {
    TinyTrace tiny;
    const auto records = run_experiment(config_on(tiny.trace, {entry("full"), lowrank(tiny.bases, 16, 16),
                                                               lowrank(tiny.bases, 3, 8), lowrank(tiny.bases, 2, 2),
                                                               lowrank(tiny.bases, 32, 32, 1),
                                                               lowrank(tiny.bases, 8, 8, 1)}),
                                        {}, false)
                             .records;
    auto row = [&](const std::string& label) -> const ResultRecord& { return record(records, with_bases(label, tiny.bases)); };
    const ResultRecord& exact = row("lowrank(key_rank=16,value_rank=16)");
    CHECK(exact.output_rel_error == 0.0);
    CHECK(exact.bytes_per_token == record(records, "full").bytes_per_token);  // no bases at full rank
    CHECK(row("lowrank(key_rank=32,value_rank=32,joint=1)").output_rel_error == 0.0);
    const ResultRecord& mid = row("lowrank(key_rank=3,value_rank=8)");
    const ResultRecord& low = row("lowrank(key_rank=2,value_rank=2)");
    CHECK(mid.output_rel_error > 0);
    CHECK(low.output_rel_error > mid.output_rel_error);
    // Per token: K and V latents at fp16 (2 bytes a number); per step the fp16 up-projections and
    // means (16 x (rank + 1) numbers each), held whatever the context: bytes/token = 2 (rk + rv) + B S / C.
    const TraceReader reader(tiny.trace);
    const AttentionShape shape = trace_shape(reader, 0);
    double steps = 0, context = 0;
    for (int64_t last : shape.last_steps)
        for (int64_t t = 1; t <= last; ++t) steps += 1, context += t + 1;
    CHECK(mid.bytes_per_token == doctest::Approx(2.0 * (3 + 8) + 2.0 * 16 * (3 + 1 + 8 + 1) * steps / context).epsilon(1e-12));
    // A joint latent of 8 numbers for the layer's 2 KV heads: each head carries half of it.
    const ResultRecord& joint = row("lowrank(key_rank=8,value_rank=8,joint=1)");
    CHECK(joint.bytes_per_token ==
          doctest::Approx((2.0 * 16 + 2.0 * 32 * (8 + 1) * 2 * steps / context) / 2).epsilon(1e-12));
    CHECK(joint.output_rel_error > 0);
}

TEST_CASE("group_heads: identical heads lose nothing; grouping halves the bytes") {
    // Two KV heads with the same keys and values: their mean is each of them, bit for bit.
    QkvLayer layer = generate_synthetic_qkv_layer(synthetic_qkv_trace("tiny-256", "test"), 0);
    for (int64_t t = 0; t < layer.tokens; ++t)
        for (int i = 0; i < 16; ++i) {
            layer.k[(t * 2 + 1) * 16 + i] = layer.k[t * 2 * 16 + i];
            layer.v[(t * 2 + 1) * 16 + i] = layer.v[t * 2 * 16 + i];
        }
    KvProjection p;
    p.kind = KvProjection::Kind::grouping;
    p.group_size = 2;
    TierArrays arrays;
    build_projected_arrays(p, 0, layer, 2, 16, nullptr, arrays);
    CHECK(arrays.storage_k16 == layer.k);
    CHECK(arrays.storage_v16 == layer.v);
    // With int8 latents, both copies quantise alike.
    TierFormat format;
    TierArrays tiered;
    build_projected_arrays(p, 0, layer, 2, 16, &format, tiered);
    for (int64_t t = 0; t < layer.tokens; ++t)
        for (int i = 0; i < 16; ++i) CHECK(tiered.k[1][(t * 2 + 1) * 16 + i] == tiered.k[1][t * 2 * 16 + i]);

    TinyTrace tiny;
    PolicyEntry fitted = entry("group_heads", {{"group", 2}, {"fitted", 1}});
    fitted.files["bases"] = tiny.bases;
    const auto records =
        run_experiment(config_on(tiny.trace, {entry("full"), entry("group_heads", {{"group", 2}}), fitted}), {}, false)
            .records;
    const ResultRecord& grouped = record(records, "group_heads");
    CHECK(grouped.output_rel_error > 0);
    CHECK(grouped.compression_ratio == doctest::Approx(2.0).epsilon(1e-12));
    // With two heads there is one way to pair them: the fitted grouping is the contiguous one.
    CHECK(record(records, with_bases("group_heads(fitted=1)", tiny.bases)).output_rel_error ==
          grouped.output_rel_error);
}

TEST_CASE("grouping by similarity pairs the nearest heads") {
    Eigen::MatrixXd distance(4, 4);
    distance << 0, 5, 1, 5,  //
        5, 0, 5, 2,          //
        1, 5, 0, 5,          //
        5, 2, 5, 0;
    CHECK(group_heads_of_layer(4, 2, &distance) == std::vector<int>{0, 1, 0, 1});
    CHECK(group_heads_of_layer(4, 2, nullptr) == std::vector<int>{0, 0, 1, 1});
    CHECK(group_heads_of_layer(4, 4, &distance) == std::vector<int>{0, 0, 0, 0});
}

TEST_CASE("lowrank composes with eviction and quantisation") {
    TinyTrace tiny;
    PolicyEntry quantised = lowrank(tiny.bases, 8, 8);
    quantised.quantized = true;
    quantised.quantize = {{"bits", 8}, {"key_group", 16}};
    PolicyEntry evicted = entry("sliding_window");
    evicted.project = "lowrank";
    evicted.project_params = {{"key_rank", 8}, {"value_rank", 8}};
    evicted.project_files = {{"bases", tiny.bases}};
    evicted.project_where = "test: project.lowrank";
    const auto records =
        run_experiment(config_on(tiny.trace, {entry("sliding_window"), lowrank(tiny.bases, 8, 8), quantised, evicted}),
                       {}, false)
            .records;
    const std::string label = with_bases("lowrank(key_rank=8,value_rank=8)", tiny.bases);
    const ResultRecord& plain = record(records, label);
    const ResultRecord& int8 = record(records, label + "+int8(key_group=16)");
    // int8 latents: the error moves a little, the latent's bytes shrink from 2 to about 1 a number.
    CHECK(int8.output_rel_error != plain.output_rel_error);
    CHECK(std::abs(int8.output_rel_error - plain.output_rel_error) < 0.05 * plain.output_rel_error);
    CHECK(int8.bytes_per_token < 0.7 * plain.bytes_per_token);
    // Evicted and projected: fewer tokens, each in fewer numbers.
    const ResultRecord& window = record(records, "sliding_window");
    const ResultRecord& both = record(records, with_bases("sliding_window+lowrank(key_rank=8,value_rank=8)", tiny.bases));
    CHECK(both.bytes_per_token < window.bytes_per_token);
    CHECK(both.bytes_per_token < plain.bytes_per_token);
    CHECK(both.output_rel_error > window.output_rel_error);
}

TEST_CASE("bases without the joint ones: the same per-head bases and distances, a smaller file, joint refused") {
    TinyTrace tiny;
    const std::string per_head = scratch("per-head.json");
    KeyFrame keys;
    keys.joint = false;
    write_kv_bases(per_head, fit_kv_bases(tiny.trace, {}, keys));
    const auto all = load_kv_bases(tiny.bases, 3, 2, 16), some = load_kv_bases(per_head, 3, 2, 16);
    CHECK(some->joint_key.empty());
    CHECK(all->joint_key.size() == 3);
    CHECK(std::filesystem::file_size(per_head) < std::filesystem::file_size(tiny.bases));
    // Head by head or as blocks of the joint moment: the same sums in another order.
    for (std::size_t u = 0; u < all->key.size(); ++u) {
        CHECK((all->key[u].mean - some->key[u].mean).norm() <= 1e-9 * all->key[u].mean.norm());
        CHECK((all->value[u].energy - some->value[u].energy).norm() <= 1e-9 * all->value[u].energy.norm());
        for (int j = 0; j < 16; ++j)  // each direction, up to its sign convention
            CHECK(std::abs(all->key[u].vectors.col(j).dot(some->key[u].vectors.col(j))) > 1 - 1e-6);
    }
    for (int layer = 0; layer < 3; ++layer)
        CHECK((all->head_distance[layer] - some->head_distance[layer]).norm() <= 1e-9 * all->head_distance[layer].norm());
    // Per-head ranks replay from it exactly as from the full file; a joint latent is refused.
    const auto records =
        run_experiment(config_on(tiny.trace, {lowrank(tiny.bases, 5, 6), lowrank(per_head, 5, 6)}), {}, false).records;
    CHECK(record(records, with_bases("lowrank(key_rank=5,value_rank=6)", tiny.bases)).output_rel_error ==
          doctest::Approx(record(records, with_bases("lowrank(key_rank=5,value_rank=6)", per_head)).output_rel_error)
              .epsilon(1e-6));
    try {
        run_experiment(config_on(tiny.trace, {lowrank(per_head, 4, 4, 1)}), {}, false);
        FAIL("no error");
    } catch (const InputError& error) {
        CHECK(contains(error.what(), per_head + ": joint = 1 needs joint bases, and this file was fitted without them"));
    }
    std::filesystem::remove(per_head);
}

TEST_CASE("bad ranks and bases of the wrong shape are input errors naming the key or file") {
    TinyTrace tiny;
    auto message = [&](const PolicyEntry& e) -> std::string {
        try {
            run_experiment(config_on(tiny.trace, {e}), {}, false);
        } catch (const InputError& error) {
            return error.what();
        }
        return "no error";
    };
    CHECK(contains(message(lowrank(tiny.bases, 17, 4)), "test: lowrank.key_rank: key_rank = 17 must be in 1..16"));
    CHECK(contains(message(lowrank(tiny.bases, 4, 33, 1)), "test: lowrank.value_rank: value_rank = 33 must be in 1..32"));
    CHECK_THROWS_AS(resolve_params(*find_policy("lowrank"), {{"key_rank", 0}}, "x"), InputError);
    CHECK(contains(message(entry("lowrank")), "lowrank needs a bases file"));
    CHECK(contains(message(entry("group_heads", {{"group", 3}})), "group = 3 must divide the trace's 2 KV heads"));

    // Bases fitted to another shape.
    KvBasesFitter other(3, 2, 8);
    const std::string wrong = scratch("wrong-shape.json");
    write_kv_bases(wrong, other.finish({}));
    CHECK(contains(message(lowrank(wrong, 4, 4)), wrong + ": bases of 3 layers x 2 KV heads x head size 8, but the "
                                                          "trace has 3 x 2 x 16"));
    // A basis vector cut short.
    std::ifstream in(tiny.bases);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::size_t at = text.find("\"vectors\":[[") + 12;
    text.erase(at, text.find(',', at) + 1 - at);  // drop the first number of the first vector
    const std::string cut = scratch("cut.json");
    std::ofstream(cut) << text;
    CHECK(contains(message(lowrank(cut, 4, 4)), cut + ": heads[0].key.vectors[0]: expected a list of 16 numbers"));
    std::filesystem::remove(wrong);
    std::filesystem::remove(cut);
}

namespace {

// Every number and attribute of two bases, bit for bit.
void check_same_bases(const KvBases& a, const KvBases& b) {
    CHECK(a.num_layers == b.num_layers);
    CHECK(a.num_kv_heads == b.num_kv_heads);
    CHECK(a.head_dim == b.head_dim);
    CHECK(a.keys == b.keys);
    CHECK(a.rope.pairing == b.rope.pairing);
    CHECK(a.rope.frequencies == b.rope.frequencies);
    CHECK(a.fitted_sequences == b.fitted_sequences);
    auto same = [](const std::vector<PcaBasis>& x, const std::vector<PcaBasis>& y) {
        REQUIRE(x.size() == y.size());
        for (std::size_t u = 0; u < x.size(); ++u) {
            CHECK(x[u].vectors == y[u].vectors);
            CHECK(x[u].energy == y[u].energy);
            CHECK(x[u].mean == y[u].mean);
        }
    };
    same(a.key, b.key);
    same(a.value, b.value);
    same(a.joint_key, b.joint_key);
    same(a.joint_value, b.joint_value);
    REQUIRE(a.head_distance.size() == b.head_distance.size());
    for (std::size_t l = 0; l < a.head_distance.size(); ++l) CHECK(a.head_distance[l] == b.head_distance[l]);
}

// The bases file at `from` copied to `to`, then changed by `edit` through HDF5 itself.
std::string edited_hdf5(const std::string& from, const std::string& to, const std::function<void(hid_t)>& edit) {
    std::filesystem::copy_file(from, to, std::filesystem::copy_options::overwrite_existing);
    const hid_t file = H5Fopen(to.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    REQUIRE(file >= 0);
    edit(file);
    H5Fclose(file);
    return to;
}

// Replaces dataset `name` by one of `type` and `shape`, filled with `value`.
void replace_dataset(hid_t file, const char* name, hid_t type, std::vector<hsize_t> shape, double value) {
    REQUIRE(H5Ldelete(file, name, H5P_DEFAULT) >= 0);
    std::size_t count = 1;
    for (hsize_t d : shape) count *= d;
    const std::vector<double> data(count, value);
    const hid_t space = H5Screate_simple(static_cast<int>(shape.size()), shape.data(), nullptr);
    const hid_t dataset = H5Dcreate2(file, name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    REQUIRE(H5Dwrite(dataset, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, data.data()) >= 0);
    H5Dclose(dataset);
    H5Sclose(space);
}

std::string read_error(const std::string& path) {
    try {
        read_kv_bases(path);
    } catch (const InputError& error) {
        return error.what();
    }
    return "no error";
}

}  // namespace

TEST_CASE("HDF5 bases: the same numbers and attributes as JSON, bit for bit, read whatever the file's name") {
    TinyTrace tiny;
    const KvBases fitted = fit_kv_bases(tiny.trace, {0});
    // What a search's bases_format: auto weighs: 3 layers x 2 heads x (16 x 16 + 2 x 16) per K and V,
    // 3 joint layers x (32 x 32 + 2 x 32) per K and V, 3 distance matrices of 2 x 2.
    CHECK(kv_bases_numbers(fitted) == 3 * 2 * (256 + 32) * 2 + 3 * (1024 + 64) * 2 + 3 * 4);
    for (const bool joint : {true, false}) {
        KeyFrame keys{true, 10000};  // pre-RoPE keys: the RoPE attributes go through too
        keys.joint = joint;
        const KvBases pre = fit_kv_bases(tiny.trace, {0}, keys);
        for (const KvBases* bases : {&fitted, &pre}) {
            const std::string h5 = scratch("round.h5"), json = scratch("round.json");
            write_kv_bases(h5, *bases);
            write_kv_bases(json, *bases);
            CHECK(kv_bases_format_of(h5) == KvBasesFormat::hdf5);
            CHECK(read_input_file(h5).rfind("\x89HDF", 0) == 0);
            CHECK(read_input_file(json).front() == '{');
            check_same_bases(*read_kv_bases(h5), *bases);
            check_same_bases(*read_kv_bases(json), *bases);
            // Either form under the other's name reads as what it is.
            std::filesystem::rename(h5, scratch("round-h5.json"));
            std::filesystem::rename(json, scratch("round-json.h5"));
            check_same_bases(*read_kv_bases(scratch("round-h5.json")), *bases);
            check_same_bases(*read_kv_bases(scratch("round-json.h5")), *bases);
            // The same bases give the same bytes (no times recorded): a refit is byte-identical.
            CHECK(kv_bases_hdf5(*bases) == read_input_file(scratch("round-h5.json")));
            std::filesystem::remove(scratch("round-h5.json"));
            std::filesystem::remove(scratch("round-json.h5"));
        }
    }
    // A replay from each form: identical records, bit for bit.
    const std::string h5 = scratch("replay.h5"), json = scratch("replay.json");
    write_kv_bases(h5, fitted);
    write_kv_bases(json, fitted);
    const auto records = run_experiment(config_on(tiny.trace, {lowrank(json, 5, 3), lowrank(h5, 5, 3),
                                                               lowrank(json, 20, 9, 1), lowrank(h5, 20, 9, 1)}),
                                        {}, false)
                             .records;
    for (const char* label : {"lowrank(key_rank=5,value_rank=3)", "lowrank(key_rank=20,value_rank=9,joint=1)"}) {
        const ResultRecord& from_json = record(records, with_bases(label, json));
        const ResultRecord& from_hdf5 = record(records, with_bases(label, h5));
        CHECK(from_json.output_rel_error > 0);
        CHECK(from_json.output_rel_error == from_hdf5.output_rel_error);
        CHECK(from_json.output_cosine == from_hdf5.output_cosine);
        CHECK(from_json.bytes_per_token == from_hdf5.bytes_per_token);
    }
    std::filesystem::remove(h5);
    std::filesystem::remove(json);
}

TEST_CASE("bad HDF5 bases: one input error naming the file and the dataset or attribute") {
    TinyTrace tiny;
    const std::string good = scratch("good.h5"), bad = scratch("bad.h5");
    write_kv_bases(good, fit_kv_bases(tiny.trace, {}));
    REQUIRE(read_error(good) == "no error");
    // Cut short: HDF5 cannot open it.
    const std::string bytes = read_input_file(good);
    std::ofstream(bad, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
    CHECK(read_error(bad) == bad + ": cannot open as HDF5 (truncated or corrupt)");
    // Neither form under the HDF5 name.
    std::ofstream(bad) << "not bases\n";
    CHECK(contains(read_error(bad), bad + ": not an HDF5 file (no HDF5 signature), and not a JSON bases file: "));
    using Edit = std::function<void(hid_t)>;
    const std::vector<std::pair<Edit, std::string>> cases = {
        {[](hid_t f) { H5Adelete(f, "keys"); }, "missing attribute 'keys'"},
        {[](hid_t f) { H5Adelete(f, "fitted_sequences"); }, "missing attribute 'fitted_sequences'"},
        {[](hid_t f) { H5Adelete(f, "version"); }, "missing attribute 'version'"},
        {[](hid_t f) { H5Adelete(f, "num_layers"); write_int_attr(f, "num_layers", 5000); },
         "attribute 'num_layers' = 5000 must be <= 4096"},
        {[](hid_t f) { H5Adelete(f, "version"); write_int_attr(f, "version", 2); },
         "root attribute 'version' is 2; this kvsim reads version 1"},
        {[](hid_t f) { H5Adelete(f, "keys"); write_string_attr(f, "keys", "sideways"); },
         "root attribute 'keys' is 'sideways' (expected post_rope or pre_rope)"},
        {[](hid_t f) { H5Adelete(f, "keys"); write_string_attr(f, "keys", "pre_rope"); },
         "missing attribute 'rope_pairing'"},
        {[](hid_t f) { H5Adelete(f, "head_dim"); write_string_attr(f, "head_dim", "16"); },
         "attribute 'head_dim' is not an integer"},
        {[](hid_t f) { replace_dataset(f, "/heads/key_mean", H5T_IEEE_F64LE, {3, 2, 15}, 0); },
         "dataset '/heads/key_mean' has shape [3, 2, 15], expected [3, 2, 16]"},
        {[](hid_t f) { replace_dataset(f, "/heads/value_energy", H5T_STD_I32LE, {3, 2, 16}, 1); },
         "dataset '/heads/value_energy' has the wrong element type"},
        {[](hid_t f) { H5Ldelete(f, "/joint/value_vectors", H5P_DEFAULT); }, "missing dataset '/joint/value_vectors'"},
        {[](hid_t f) { replace_dataset(f, "/heads/key_vectors", H5T_IEEE_F64LE, {3, 2, 16, 16}, 0); },
         "dataset '/heads/key_vectors' [layer 0, KV head 0, vector 0]: has length 0.000000; a basis vector has length 1"},
        {[](hid_t f) { replace_dataset(f, "/joint/key_mean", H5T_IEEE_F64LE, {3, 32}, 1e39); },
         "dataset '/joint/key_mean' [layer 0, element 0]: 1e+39 is outside float's range"},
        {[](hid_t f) { replace_dataset(f, "/head_distance", H5T_IEEE_F32LE, {3, 2, 2}, -1); },
         "dataset '/head_distance' [layer 0, 0, 0]: a distance is at least 0"},
    };
    for (const auto& one_case : cases) {  // no structured binding: clang 14 cannot capture one in CAPTURE
        const auto& [edit, fragment] = one_case;
        CAPTURE(one_case.second);
        const std::string message = read_error(edited_hdf5(good, bad, edit));
        CHECK(contains(message, bad + ": "));
        CHECK(contains(message, fragment));
        CHECK(message.find('\n') == std::string::npos);
    }
    // Through the policy, whose loader caches by path: the same line.
    const auto policy_error = [&](const std::string& path) -> std::string {
        try {
            run_experiment(config_on(tiny.trace, {lowrank(path, 4, 4)}), {}, false);
        } catch (const InputError& error) {
            return error.what();
        }
        return "no error";
    };
    const std::string shape = edited_hdf5(good, scratch("shape.h5"), [](hid_t f) {
        replace_dataset(f, "/head_distance", H5T_IEEE_F64LE, {3, 2, 3}, 0);
    });
    CHECK(contains(policy_error(shape), shape + ": dataset '/head_distance' has shape [3, 2, 3], expected [3, 2, 2]"));
    for (const std::string& p : {good, bad, shape}) std::filesystem::remove(p);
}
