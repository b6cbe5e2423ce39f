#include "cache_math/lowrank.h"

#include <Eigen/Eigenvalues>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>

#include "base/atomic_file.h"
#include "base/errors.h"
#include "base/hdf5_file.h"
#include "base/input_file.h"
#include "base/json_file.h"
#include "base/size_limits.h"
#include "cache_math/tiers.h"

namespace kvsim {

using Json = nlohmann::ordered_json;

PcaBasis pca_from_second_moment(const Eigen::MatrixXd& second_moment) {
    const Eigen::Index n = second_moment.rows();
    Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> solver(second_moment);
    PcaBasis basis;
    basis.vectors.resize(n, n);
    basis.energy.resize(n);
    // Eigen orders eigenvalues ascending; the cache wants the strongest directions first. Each
    // vector's sign is fixed (its largest component positive) so that a refit is bit-identical.
    for (Eigen::Index j = 0; j < n; ++j) {
        Eigen::VectorXd v = solver.eigenvectors().col(n - 1 - j);
        Eigen::Index at = 0;
        v.cwiseAbs().maxCoeff(&at);
        if (v[at] < 0) v = -v;
        basis.vectors.col(j) = v;
        basis.energy[j] = solver.eigenvalues()[n - 1 - j];
    }
    return basis;
}

KvBasesFitter::KvBasesFitter(int num_layers, int num_kv_heads, int head_dim, Rope rope, bool joint)
    : layers_(num_layers), heads_(num_kv_heads), dim_(head_dim), rope_(std::move(rope)), joint_(joint) {
    const Eigen::MatrixXd zero_head = Eigen::MatrixXd::Zero(dim_, dim_);
    key_moment_.assign(static_cast<std::size_t>(layers_) * heads_, zero_head);
    value_moment_ = key_moment_;
    if (joint_) {
        joint_key_moment_.assign(layers_, Eigen::MatrixXd::Zero(heads_ * dim_, heads_ * dim_));
        joint_value_moment_ = joint_key_moment_;
    }
    key_diff_.assign(layers_, Eigen::MatrixXd::Zero(heads_, heads_));
    value_diff_ = key_diff_;
    key_norm_.assign(layers_, Eigen::VectorXd::Zero(heads_));
    key_sum_.assign(layers_, Eigen::VectorXd::Zero(static_cast<Eigen::Index>(heads_) * dim_));
    value_sum_ = key_sum_;
    value_norm_ = key_norm_;
    tokens_.assign(layers_, 0);
}

void KvBasesFitter::add(int layer, const QkvLayer& data, const std::vector<float>* keys_before_rope) {
    const Eigen::Index width = static_cast<Eigen::Index>(heads_) * dim_;
    using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    std::vector<float> unrotated;
    const std::vector<float>* keys = &data.k;
    if (rope_.known() && keys_before_rope) {  // keys as the model had them before RoPE
        keys = keys_before_rope;
    } else if (rope_.known()) {  // the same, up to float rounding: the recorded keys rotated back
        unrotated = data.k;
        apply_rope_rows(unrotated.data(), 0, data.tokens, heads_, dim_, rope_, true);
        keys = &unrotated;
    }
    for (int which = 0; which < 2; ++which) {
        const std::vector<float>& x = which == 0 ? *keys : data.v;
        const Eigen::Map<const RowMajor> all(x.data(), data.tokens, width);
        const Eigen::MatrixXd tokens = all.cast<double>();
        (which == 0 ? key_sum_ : value_sum_)[layer] += tokens.colwise().sum().transpose();
        auto& own = which == 0 ? key_moment_ : value_moment_;
        auto& diff = which == 0 ? key_diff_ : value_diff_;
        auto& norm = which == 0 ? key_norm_ : value_norm_;
        // Head a's moment, and tr(M_ab) = sum over tokens of x_a . x_b between heads: blocks of the
        // joint moment where it is fitted (one product gives all), else head by head.
        Eigen::MatrixXd cross(heads_, heads_);
        if (joint_) {
            const Eigen::MatrixXd moment = tokens.transpose() * tokens;
            (which == 0 ? joint_key_moment_ : joint_value_moment_)[layer] += moment;
            for (int a = 0; a < heads_; ++a) {
                own[static_cast<std::size_t>(layer) * heads_ + a] += moment.block(a * dim_, a * dim_, dim_, dim_);
                for (int b = 0; b < heads_; ++b) cross(a, b) = moment.block(a * dim_, b * dim_, dim_, dim_).trace();
            }
        } else {
            for (int a = 0; a < heads_; ++a) {
                const auto head = tokens.middleCols(a * dim_, dim_);
                own[static_cast<std::size_t>(layer) * heads_ + a] += head.transpose() * head;
                for (int b = 0; b < heads_; ++b) cross(a, b) = head.cwiseProduct(tokens.middleCols(b * dim_, dim_)).sum();
            }
        }
        // |x_a - x_b|^2 summed over tokens = tr(M_aa) + tr(M_bb) - 2 tr(M_ab).
        for (int a = 0; a < heads_; ++a) {
            norm[layer][a] += cross(a, a);
            for (int b = 0; b < heads_; ++b) diff[layer](a, b) += cross(a, a) + cross(b, b) - 2 * cross(a, b);
        }
    }
    tokens_[layer] += data.tokens;
}

KvBases KvBasesFitter::finish(std::vector<int> fitted_sequences) const {
    KvBases out;
    out.num_layers = layers_;
    out.num_kv_heads = heads_;
    out.head_dim = dim_;
    out.fitted_sequences = std::move(fitted_sequences);
    if (rope_.known()) out.keys = "pre_rope", out.rope = rope_;
    for (int layer = 0; layer < layers_; ++layer) {
        const double n = std::max<int64_t>(tokens_[layer], 1);
        // Covariance = E[x x^T] - mean mean^T.
        auto centred = [n](const Eigen::MatrixXd& moment, const Eigen::VectorXd& sum) {
            const Eigen::VectorXd mean = sum / n;
            PcaBasis b = pca_from_second_moment(moment / n - mean * mean.transpose());
            b.mean = mean;
            return b;
        };
        for (int kv = 0; kv < heads_; ++kv) {
            const std::size_t u = static_cast<std::size_t>(layer) * heads_ + kv;
            out.key.push_back(centred(key_moment_[u], key_sum_[layer].segment(kv * dim_, dim_)));
            out.value.push_back(centred(value_moment_[u], value_sum_[layer].segment(kv * dim_, dim_)));
        }
        if (joint_) {
            out.joint_key.push_back(centred(joint_key_moment_[layer], key_sum_[layer]));
            out.joint_value.push_back(centred(joint_value_moment_[layer], value_sum_[layer]));
        }
        // A pair's distance: the squared difference of their keys, relative to the keys' energy,
        // plus the same for values; what mean-pooling the pair would lose, to first order.
        Eigen::MatrixXd distance = Eigen::MatrixXd::Zero(heads_, heads_);
        for (int a = 0; a < heads_; ++a)
            for (int b = 0; b < heads_; ++b) {
                if (a == b) continue;
                const double key_energy = key_norm_[layer][a] + key_norm_[layer][b];
                const double value_energy = value_norm_[layer][a] + value_norm_[layer][b];
                distance(a, b) = (key_energy > 0 ? std::max(key_diff_[layer](a, b), 0.0) / key_energy : 0) +
                                 (value_energy > 0 ? std::max(value_diff_[layer](a, b), 0.0) / value_energy : 0);
            }
        out.head_distance.push_back(distance);
    }
    return out;
}

namespace {

Json basis_json(const PcaBasis& b) {
    Json vectors = Json::array();
    for (Eigen::Index j = 0; j < b.vectors.cols(); ++j) {
        Json column = Json::array();
        for (Eigen::Index i = 0; i < b.vectors.rows(); ++i) column.push_back(b.vectors(i, j));
        vectors.push_back(std::move(column));
    }
    Json energy = Json::array(), mean = Json::array();
    for (Eigen::Index j = 0; j < b.energy.size(); ++j) energy.push_back(b.energy[j]);
    for (Eigen::Index j = 0; j < b.mean.size(); ++j) mean.push_back(b.mean[j]);
    return Json{{"vectors", std::move(vectors)}, {"energy", std::move(energy)}, {"mean", std::move(mean)}};
}

// An integer in [lo, hi], checked before it is narrowed (2^32 + 5 is not 5).
int64_t bounded_integer(const Json& j, const std::string& where, int64_t lo, int64_t hi) {
    if (!j.is_number_integer()) throw InputError(where + ": not an integer");
    const bool above = j.is_number_unsigned() ? j.get<uint64_t>() > static_cast<uint64_t>(hi) : j.get<int64_t>() > hi;
    if (above || j.get<int64_t>() < lo)
        throw InputError(where + ": " + j.dump() + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return j.get<int64_t>();
}

// "version": 1, the only version of the bases and ranks files.
void require_version_1(const Json& root, const std::string& path) {
    const auto it = root.find("version");
    if (it == root.end()) throw InputError(path + ": 'version' missing");
    if (bounded_integer(*it, path + ": 'version'", 0, 1 << 30) != 1)
        throw InputError(path + ": 'version' " + it->dump() + " is not 1, the only version this kvsim reads");
}

// Names one number of a basis in a message: field "vectors", "energy" or "mean"; j its index (the
// vector's, for vectors), i the vector's element or -1.
using BasisPlace = std::function<std::string(const char* field, int j, int i)>;

std::string float_text(double v) {
    char text[32];
    std::snprintf(text, sizeof text, "%g", v);
    return text;
}

// What every bases file must hold, whatever its form: numbers the cache can compute with in float,
// unit basis vectors, and the eigenvalues of a covariance (at least zero up to rounding, strongest
// first: ranks keep the first).
void check_basis(const PcaBasis& b, const BasisPlace& at) {
    const int n = static_cast<int>(b.energy.size());
    auto in_float = [&](double v, const char* field, int j, int i) {
        if (!(std::fabs(v) <= std::numeric_limits<float>::max()))
            throw InputError(at(field, j, i) + ": " + float_text(v) + " is outside float's range (the cache computes in float)");
    };
    for (int j = 0; j < n; ++j) in_float(b.mean[j], "mean", j, -1);
    for (int j = 0; j < n; ++j) {
        for (int i = 0; i < n; ++i) in_float(b.vectors(i, j), "vectors", j, i);
        // A principal direction has unit length: a zero (or scaled) column projects every token to
        // nothing (or more than it is) and its errors come out NaN or wrong, not refused.
        const double length = b.vectors.col(j).norm();
        if (!(std::fabs(length - 1) <= 1e-3))
            throw InputError(at("vectors", j, -1) + ": has length " + std::to_string(length) + "; a basis vector has length 1");
        in_float(b.energy[j], "energy", j, -1);
    }
    const double scale = std::max(1.0, b.energy.cwiseAbs().maxCoeff());
    for (int j = 0; j < n; ++j) {
        if (b.energy[j] < -1e-6 * scale) throw InputError(at("energy", j, -1) + ": " + std::to_string(b.energy[j]) + " is negative");
        if (j > 0 && b.energy[j] > b.energy[j - 1] + 1e-9 * scale)
            throw InputError(at("energy", j, -1) + ": energies must descend (the strongest direction first)");
    }
}

// A layer's head distances: in float's range and at least 0.
void check_head_distance(const Eigen::MatrixXd& m, const std::function<std::string(int a, int b)>& at) {
    for (int a = 0; a < m.rows(); ++a)
        for (int b = 0; b < m.cols(); ++b) {
            if (!(std::fabs(m(a, b)) <= std::numeric_limits<float>::max()))
                throw InputError(at(a, b) + ": " + float_text(m(a, b)) + " is outside float's range (the cache computes in float)");
            if (m(a, b) < 0) throw InputError(at(a, b) + ": a distance is at least 0");
        }
}

// A JSON number as a double ("not a number" naming where otherwise).
double json_number(const Json& j, const std::string& where) {
    if (!j.is_number()) throw InputError(where + ": not a number");
    return j.get<double>();
}

// One basis: `vectors`, n lists of n numbers, and `energy`, n numbers.
PcaBasis basis_from_json(const Json& node, int n, const std::string& where) {
    if (!node.is_object()) throw InputError(where + ": expected an object with vectors and energy");
    const auto vectors = node.find("vectors");
    const auto energy = node.find("energy");
    const auto mean = node.find("mean");
    if (mean == node.end() || !mean->is_array()) throw InputError(where + ".mean: missing or not a list");
    if (mean->size() != static_cast<std::size_t>(n))
        throw InputError(where + ".mean: " + std::to_string(mean->size()) + " values, expected " + std::to_string(n));
    if (vectors == node.end() || !vectors->is_array())
        throw InputError(where + ".vectors: missing or not a list");
    if (energy == node.end() || !energy->is_array()) throw InputError(where + ".energy: missing or not a list");
    if (vectors->size() != static_cast<std::size_t>(n))
        throw InputError(where + ".vectors: " + std::to_string(vectors->size()) + " vectors, expected " +
                         std::to_string(n) + " (the trace's shape)");
    if (energy->size() != static_cast<std::size_t>(n))
        throw InputError(where + ".energy: " + std::to_string(energy->size()) + " values, expected " +
                         std::to_string(n));
    const BasisPlace at = [&where](const char* field, int j, int i) {
        return where + "." + field + "[" + std::to_string(j) + "]" + (i >= 0 ? "[" + std::to_string(i) + "]" : "");
    };
    PcaBasis b;
    b.vectors.resize(n, n);
    b.energy.resize(n);
    b.mean.resize(n);
    for (int j = 0; j < n; ++j) b.mean[j] = json_number((*mean)[j], at("mean", j, -1));
    for (int j = 0; j < n; ++j) {
        const Json& column = (*vectors)[j];
        if (!column.is_array() || column.size() != static_cast<std::size_t>(n))
            throw InputError(at("vectors", j, -1) + ": expected a list of " + std::to_string(n) + " numbers");
        for (int i = 0; i < n; ++i) b.vectors(i, j) = json_number(column[i], at("vectors", j, i));
        b.energy[j] = json_number((*energy)[j], at("energy", j, -1));
    }
    check_basis(b, at);
    return b;
}

int int_field(const Json& root, const char* key, const std::string& path) {
    const auto it = root.find(key);
    if (it == root.end() || !it->is_number_integer())
        throw InputError(path + ": '" + key + "' missing or not an integer");
    return static_cast<int>(bounded_integer(*it, path + ": '" + key + "'", 1, 4096));
}

const Json& list_field(const Json& root, const char* key, std::size_t size, const std::string& path) {
    const auto it = root.find(key);
    if (it == root.end() || !it->is_array()) throw InputError(path + ": '" + key + "' missing or not a list");
    if (it->size() != size)
        throw InputError(path + ": '" + key + "' has " + std::to_string(it->size()) + " entries, expected " +
                         std::to_string(size) + " (the trace's shape)");
    return *it;
}

std::shared_ptr<const KvBases> read_kv_bases_json(const std::string& path) {
    const Json root = load_ordered_json_file(path);
    if (!root.is_object() || !root.contains("format") || root["format"] != "kvsim-kv-bases")
        throw InputError(path + ": 'format' is not kvsim-kv-bases (write the file with kvsim trace bases)");
    require_version_1(root, path);
    auto bases = std::make_shared<KvBases>();
    bases->num_layers = int_field(root, "num_layers", path);
    bases->num_kv_heads = int_field(root, "num_kv_heads", path);
    bases->head_dim = int_field(root, "head_dim", path);
    if (bases->num_layers < 1 || bases->num_kv_heads < 1 || bases->head_dim < 1 || bases->num_kv_heads > 4096 ||
        bases->head_dim > 4096 || bases->num_layers > 4096)
        throw InputError(path + ": num_layers, num_kv_heads and head_dim must be in 1..4096");
    const int layers = bases->num_layers, heads = bases->num_kv_heads, dim = bases->head_dim;
    const auto keys = root.find("keys");
    if (keys == root.end() || !keys->is_string() || (*keys != "post_rope" && *keys != "pre_rope"))
        throw InputError(path + ": 'keys' must be post_rope or pre_rope");
    bases->keys = keys->get<std::string>();
    if (bases->keys == "pre_rope") {
        if (bases->head_dim % 2 != 0) throw InputError(path + ": pre_rope keys need an even head_dim");
        const auto rope = root.find("rope");
        const auto theta = root.find("rope_theta");  // files written before the RoPE was recorded
        if (rope == root.end() && theta != root.end()) {
            if (!theta->is_number() || !(theta->get<double>() > 0) || !std::isfinite(theta->get<double>()))
                throw InputError(path + ": 'rope_theta' must be a positive number for pre_rope keys");
            bases->rope = Rope{RopePairing::adjacent, rope_base_frequencies(theta->get<double>(), bases->head_dim)};
        } else if (rope == root.end() || !rope->is_object())
            throw InputError(path + ": 'rope' must be an object {pairing, frequencies} for pre_rope keys");
        else {
            const auto pairing = rope->find("pairing");
            if (pairing == rope->end() || !pairing->is_string() ||
                !parse_rope_pairing(pairing->get<std::string>(), bases->rope.pairing))
                throw InputError(path + ": 'rope.pairing' must be adjacent or halves");
            const auto frequencies = rope->find("frequencies");
            if (frequencies == rope->end() || !frequencies->is_array() ||
                frequencies->size() != static_cast<std::size_t>(bases->head_dim / 2))
                throw InputError(path + ": 'rope.frequencies' must hold head_dim / 2 = " +
                                 std::to_string(bases->head_dim / 2) + " numbers");
            for (const Json& f : *frequencies) {
                if (!f.is_number() || !(f.get<double>() > 0) || !std::isfinite(f.get<double>()))
                    throw InputError(path + ": 'rope.frequencies' must be positive numbers");
                bases->rope.frequencies.push_back(f.get<double>());
            }
        }
    }
    if (const auto fitted = root.find("fitted_sequences"); fitted != root.end()) {
        if (!fitted->is_array()) throw InputError(path + ": 'fitted_sequences' is not a list");
        for (std::size_t i = 0; i < fitted->size(); ++i)
            bases->fitted_sequences.push_back(static_cast<int>(
                bounded_integer((*fitted)[i], path + ": 'fitted_sequences[" + std::to_string(i) + "]'", 0, INT32_MAX)));
    }
    const Json& per_head = list_field(root, "heads", static_cast<std::size_t>(layers) * heads, path);
    for (std::size_t u = 0; u < per_head.size(); ++u) {
        const std::string where = path + ": heads[" + std::to_string(u) + "]";
        if (!per_head[u].is_object()) throw InputError(where + ": expected an object");
        // Entries are applied in order, layer by layer: the labels must say so (a duplicate or a
        // layer the trace lacks would otherwise be applied to whichever head its place is).
        for (const auto& [label, expected] : {std::pair<const char*, int64_t>{"layer", u / heads}, {"kv_head", u % heads}}) {
            const auto it = per_head[u].find(label);
            if (it == per_head[u].end()) throw InputError(where + "." + label + ": missing");
            const int64_t got = bounded_integer(*it, where + "." + label, 0, 1 << 30);
            if (got != expected)
                throw InputError(where + "." + label + ": " + std::to_string(got) + ", but entry " + std::to_string(u) +
                                 " is layer " + std::to_string(u / heads) + ", KV head " + std::to_string(u % heads) +
                                 " (entries go layer by layer, KV heads in order)");
        }
        bases->key.push_back(basis_from_json(per_head[u].value("key", Json()), dim, where + ".key"));
        bases->value.push_back(basis_from_json(per_head[u].value("value", Json()), dim, where + ".value"));
    }
    // Joint bases are optional (kvsim trace bases --no-joint): a joint lowrank policy refuses a file without.
    const bool has_joint = root.contains("joint");
    const Json& joint = has_joint ? list_field(root, "joint", layers, path) : root;
    const Json& distance = list_field(root, "head_distance", layers, path);
    for (int layer = 0; layer < layers; ++layer) {
        const std::string where = path + ": joint[" + std::to_string(layer) + "]";
        if (has_joint) {
            if (!joint[layer].is_object()) throw InputError(where + ": expected an object");
            bases->joint_key.push_back(basis_from_json(joint[layer].value("key", Json()), heads * dim, where + ".key"));
            bases->joint_value.push_back(
                basis_from_json(joint[layer].value("value", Json()), heads * dim, where + ".value"));
        }
        const std::string at = path + ": head_distance[" + std::to_string(layer) + "]";
        const Json& rows = distance[layer];
        if (!rows.is_array() || rows.size() != static_cast<std::size_t>(heads))
            throw InputError(at + ": expected " + std::to_string(heads) + " rows");
        Eigen::MatrixXd m(heads, heads);
        for (int a = 0; a < heads; ++a) {
            if (!rows[a].is_array() || rows[a].size() != static_cast<std::size_t>(heads))
                throw InputError(at + "[" + std::to_string(a) + "]: expected " + std::to_string(heads) + " numbers");
            for (int b = 0; b < heads; ++b)
                m(a, b) = json_number(rows[a][b], at + "[" + std::to_string(a) + "][" + std::to_string(b) + "]");
        }
        check_head_distance(m, [&at](int a, int b) { return at + "[" + std::to_string(a) + "][" + std::to_string(b) + "]"; });
        bases->head_distance.push_back(m);
    }
    return bases;
}


// ---- The HDF5 form (docs/lowrank.md, "The bases file"): the JSON form's fields as root attributes
// and float64 datasets, one per kind of number, layer-major.

constexpr const char* kBasesFormat = "kvsim-kv-bases";

// The per (layer, KV head) and per layer (joint) datasets of one kind, key or value.
std::string basis_dataset(bool joint, bool key, const char* field) {
    return std::string(joint ? "/joint/" : "/heads/") + (key ? "key_" : "value_") + field;
}

// A float64 dataset, contiguous: eigenvectors do not compress (deflate saves a few percent), and
// no modification times, so that the same bases give the same bytes.
Hdf5Handle create_doubles(hid_t file, const std::string& name, const std::vector<hsize_t>& shape) {
    Hdf5Handle space = hdf5_space(H5Screate_simple(static_cast<int>(shape.size()), shape.data(), nullptr));
    Hdf5Handle dcpl = hdf5_plist(H5Pcreate(H5P_DATASET_CREATE));
    H5Pset_obj_track_times(dcpl.get(), 0);
    Hdf5Handle dataset = hdf5_dataset(
        H5Dcreate2(file, name.c_str(), H5T_IEEE_F64LE, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT));
    if (!dataset.valid()) throw std::runtime_error("cannot create dataset " + name + " of the bases");
    return dataset;
}

// Entry u (of the leading `leading` dimensions, flattened) of a dataset of `shape`: the block of
// the trailing dimensions, written from `data` as it lies in memory.
void write_entry(const Hdf5Handle& dataset, const std::string& name, const std::vector<hsize_t>& shape,
                 std::size_t leading, hsize_t u, const double* data) {
    std::vector<hsize_t> start(shape.size(), 0), count = shape;
    for (std::size_t d = leading; d-- > 0;) {
        start[d] = u % shape[d];
        u /= shape[d];
        count[d] = 1;
    }
    hsize_t elements = 1;
    for (hsize_t c : count) elements *= c;
    Hdf5Handle file_space = hdf5_space(H5Dget_space(dataset.get()));
    Hdf5Handle memory = hdf5_space(H5Screate_simple(1, &elements, nullptr));
    if (H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr) < 0 ||
        H5Dwrite(dataset.get(), H5T_NATIVE_DOUBLE, memory.get(), file_space.get(), H5P_DEFAULT, data) < 0)
        throw std::runtime_error("cannot write dataset " + name + " of the bases");
}

// Bases of n-vectors, `units` of them, as three datasets [units..., n, n], [units..., n], [units..., n],
// basis by basis (no copy of them all: the joint bases are 134 MB a kind at the 1B shape).
void write_bases(hid_t file, bool joint, bool key, const std::vector<PcaBasis>& bases, std::vector<hsize_t> units) {
    const std::size_t leading = units.size();
    const hsize_t n = bases.empty() ? 0 : static_cast<hsize_t>(bases[0].energy.size());
    units.push_back(n);
    const std::string energy = basis_dataset(joint, key, "energy"), mean = basis_dataset(joint, key, "mean");
    const Hdf5Handle energy_set = create_doubles(file, energy, units), mean_set = create_doubles(file, mean, units);
    for (std::size_t u = 0; u < bases.size(); ++u) {
        write_entry(energy_set, energy, units, leading, u, bases[u].energy.data());
        write_entry(mean_set, mean, units, leading, u, bases[u].mean.data());
    }
    units.push_back(n);
    const std::string vectors = basis_dataset(joint, key, "vectors");
    const Hdf5Handle vectors_set = create_doubles(file, vectors, units);
    // Column-major: vector j's n elements in a row, as the JSON form's "vectors" lists them.
    for (std::size_t u = 0; u < bases.size(); ++u) write_entry(vectors_set, vectors, units, leading, u, bases[u].vectors.data());
}

Hdf5Handle untimed_group(hid_t file, const char* name) {
    Hdf5Handle gcpl = hdf5_plist(H5Pcreate(H5P_GROUP_CREATE));
    H5Pset_obj_track_times(gcpl.get(), 0);
    Hdf5Handle group = hdf5_group(H5Gcreate2(file, name, H5P_DEFAULT, gcpl.get(), H5P_DEFAULT));
    if (!group.valid()) throw std::runtime_error(std::string("cannot create group ") + name + " of the bases");
    return group;
}

// The whole dataset `name` of the expected shape, as doubles: any floating-point type (kvsim writes
// float64), its data in this file, within the memory limit.
std::vector<double> read_doubles(const Hdf5Reader& r, const std::string& name, const std::vector<hsize_t>& shape) {
    const Hdf5Handle dataset = r.open_dataset(name, H5T_FLOAT, shape);
    r.check_stored(name, dataset, shape);
    uint64_t elements = 1;
    for (hsize_t d : shape) elements = checked_mul(elements, d, r.path() + ": dataset '" + name + "'");
    check_memory(checked_mul(elements, sizeof(double), r.path()), r.path() + ": dataset '" + name + "' " + show_shape(shape));
    std::vector<double> out(elements);
    r.read_all(name, dataset, H5T_NATIVE_DOUBLE, out.data());
    return out;
}

// `count` bases of n-vectors from the three datasets of one kind; `unit` names entry u in messages.
std::vector<PcaBasis> read_bases(const Hdf5Reader& r, bool joint, bool key, std::vector<hsize_t> units, int n,
                                 const std::function<std::string(std::size_t)>& unit) {
    std::size_t count = 1;
    for (hsize_t d : units) count *= d;
    const std::size_t nn = static_cast<std::size_t>(n);
    units.push_back(nn);
    const std::vector<double> energy = read_doubles(r, basis_dataset(joint, key, "energy"), units);
    const std::vector<double> mean = read_doubles(r, basis_dataset(joint, key, "mean"), units);
    units.push_back(nn);
    const std::vector<double> vectors = read_doubles(r, basis_dataset(joint, key, "vectors"), units);
    std::vector<PcaBasis> out(count);
    for (std::size_t u = 0; u < count; ++u) {
        PcaBasis& b = out[u];
        b.vectors = Eigen::Map<const Eigen::MatrixXd>(vectors.data() + u * nn * nn, n, n);
        b.energy = Eigen::Map<const Eigen::VectorXd>(energy.data() + u * nn, n);
        b.mean = Eigen::Map<const Eigen::VectorXd>(mean.data() + u * nn, n);
        check_basis(b, [&](const char* field, int j, int i) {
            return r.path() + ": dataset '" + basis_dataset(joint, key, field) + "' [" + unit(u) + ", " +
                   (std::string(field) == "vectors" ? "vector " : "element ") + std::to_string(j) +
                   (i >= 0 ? ", element " + std::to_string(i) : "") + "]";
        });
    }
    return out;
}

std::shared_ptr<const KvBases> read_kv_bases_hdf5(const std::string& path) {
    const Hdf5Reader r(path);
    const hid_t root = r.file();
    if (H5Aexists(root, "format") <= 0) r.fail("not a kvsim bases file (no root attribute 'format')");
    const std::string format = r.string_attr(root, "", "format");
    if (format != kBasesFormat)
        r.fail("root attribute 'format' is '" + format + "', not kvsim-kv-bases (write the file with kvsim trace bases)");
    const int64_t version = r.int_attr(root, "", "version", 0);
    if (version != 1) r.fail("root attribute 'version' is " + std::to_string(version) + "; this kvsim reads version 1");
    auto bases = std::make_shared<KvBases>();
    bases->num_layers = static_cast<int>(r.int_attr(root, "", "num_layers", 1, 4096));
    bases->num_kv_heads = static_cast<int>(r.int_attr(root, "", "num_kv_heads", 1, 4096));
    bases->head_dim = static_cast<int>(r.int_attr(root, "", "head_dim", 1, 4096));
    const int layers = bases->num_layers, heads = bases->num_kv_heads, dim = bases->head_dim;
    bases->keys = r.string_attr(root, "", "keys");
    if (bases->keys != "post_rope" && bases->keys != "pre_rope")
        r.fail("root attribute 'keys' is '" + bases->keys + "' (expected post_rope or pre_rope)");
    if (bases->keys == "pre_rope") {
        if (dim % 2 != 0) r.fail("pre_rope keys need an even head_dim");
        const std::string pairing = r.string_attr(root, "", "rope_pairing");
        if (!parse_rope_pairing(pairing, bases->rope.pairing))
            r.fail("root attribute 'rope_pairing' is '" + pairing + "' (expected adjacent or halves)");
        bases->rope.frequencies = r.double_array_attr(root, "rope_frequencies", static_cast<std::size_t>(dim / 2), "head_dim / 2");
        for (std::size_t i = 0; i < bases->rope.frequencies.size(); ++i)
            if (!(bases->rope.frequencies[i] > 0) || !std::isfinite(bases->rope.frequencies[i]))
                r.fail("root attribute 'rope_frequencies': element " + std::to_string(i) + " is " +
                       float_text(bases->rope.frequencies[i]) + "; frequencies must be positive and finite");
    } else if (H5Aexists(root, "rope_pairing") > 0 || H5Aexists(root, "rope_frequencies") > 0) {
        r.fail("root attributes 'rope_pairing' and 'rope_frequencies' are for pre_rope keys, but 'keys' is post_rope");
    }
    for (int64_t s : r.int_array_attr(root, "fitted_sequences", 1 << 20, 0, INT32_MAX))
        bases->fitted_sequences.push_back(static_cast<int>(s));
    const hsize_t L = layers, K = heads;
    auto head_unit = [heads](std::size_t u) {
        return "layer " + std::to_string(u / heads) + ", KV head " + std::to_string(u % heads);
    };
    auto layer_unit = [](std::size_t u) { return "layer " + std::to_string(u); };
    bases->key = read_bases(r, false, true, {L, K}, dim, head_unit);
    bases->value = read_bases(r, false, false, {L, K}, dim, head_unit);
    // Joint bases are optional (kvsim trace bases --no-joint): a joint lowrank policy refuses a file without.
    if (r.has_link("/joint")) {
        bases->joint_key = read_bases(r, true, true, {L}, heads * dim, layer_unit);
        bases->joint_value = read_bases(r, true, false, {L}, heads * dim, layer_unit);
    }
    const std::vector<double> distance = read_doubles(r, "/head_distance", {L, K, K});
    for (int layer = 0; layer < layers; ++layer) {
        // Stored [a][b], row-major: the transpose of Eigen's column-major map, and symmetric anyway.
        Eigen::MatrixXd m = Eigen::Map<const Eigen::MatrixXd>(distance.data() + layer * K * K, heads, heads).transpose();
        check_head_distance(m, [&](int a, int b) {
            return path + ": dataset '/head_distance' [layer " + std::to_string(layer) + ", " + std::to_string(a) + ", " +
                   std::to_string(b) + "]";
        });
        bases->head_distance.push_back(std::move(m));
    }
    return bases;
}

// The HDF5 form's attributes and datasets, into a new file.
void write_kv_bases_hdf5(hid_t root, const KvBases& bases) {
    write_string_attr(root, "format", kBasesFormat);
    write_int_attr(root, "version", 1);
    write_int_attr(root, "num_layers", bases.num_layers);
    write_int_attr(root, "num_kv_heads", bases.num_kv_heads);
    write_int_attr(root, "head_dim", bases.head_dim);
    write_string_attr(root, "keys", bases.keys);
    write_int_array_attr(root, "fitted_sequences", {bases.fitted_sequences.begin(), bases.fitted_sequences.end()});
    if (bases.rope.known()) {
        write_string_attr(root, "rope_pairing", to_string(bases.rope.pairing));
        write_double_array_attr(root, "rope_frequencies", bases.rope.frequencies);
    }
    const hsize_t L = bases.num_layers, K = bases.num_kv_heads;
    untimed_group(root, "/heads");
    write_bases(root, false, true, bases.key, {L, K});
    write_bases(root, false, false, bases.value, {L, K});
    if (!bases.joint_key.empty()) {
        untimed_group(root, "/joint");
        write_bases(root, true, true, bases.joint_key, {L});
        write_bases(root, true, false, bases.joint_value, {L});
    }
    const Hdf5Handle distance = create_doubles(root, "/head_distance", {L, K, K});
    for (std::size_t layer = 0; layer < bases.head_distance.size(); ++layer) {
        const Eigen::MatrixXd rows = bases.head_distance[layer].transpose();  // [a][b] row-major
        write_entry(distance, "/head_distance", {L, K, K}, 1, layer, rows.data());
    }
}

}  // namespace

std::shared_ptr<const KvBases> read_kv_bases(const std::string& path) {
    require_regular_file(path);
    // By the file's own signature, whatever its name: a JSON file named .h5 reads as JSON.
    if (has_hdf5_signature(path)) return read_kv_bases_hdf5(path);
    if (kv_bases_format_of(path) == KvBasesFormat::json) return read_kv_bases_json(path);
    try {
        return read_kv_bases_json(path);
    } catch (const InputError& e) {  // named .h5, and neither form: say both
        std::string why = e.what();
        if (why.rfind(path + ": ", 0) == 0) why = why.substr(path.size() + 2);
        throw InputError(path + ": not an HDF5 file (no HDF5 signature), and not a JSON bases file: " + why);
    }
}

KvBasesFormat kv_bases_format_of(const std::string& path) {
    const auto dot = path.rfind('.');
    const std::string extension = dot == std::string::npos ? "" : path.substr(dot);
    return extension == ".h5" || extension == ".hdf5" ? KvBasesFormat::hdf5 : KvBasesFormat::json;
}

std::string kv_bases_hdf5(const KvBases& bases) {
    silence_hdf5_here();
    // Built in memory (HDF5's core driver, no backing file) and returned as the file's bytes, for a
    // search's folder commit, which writes its files together.
    static std::atomic<uint64_t> serial{0};
    const std::string name = "kvsim-bases-" + std::to_string(serial++);
    Hdf5Handle fapl = hdf5_plist(H5Pcreate(H5P_FILE_ACCESS));
    H5Pset_fapl_core(fapl.get(), 1 << 20, 0);
    Hdf5Handle file(H5Fcreate(name.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), H5Fclose);
    if (!file.valid()) throw std::runtime_error("cannot create the HDF5 image of the bases");
    write_kv_bases_hdf5(file.get(), bases);
    if (H5Fflush(file.get(), H5F_SCOPE_LOCAL) < 0) throw std::runtime_error("cannot flush the HDF5 image of the bases");
    const ssize_t size = H5Fget_file_image(file.get(), nullptr, 0);
    std::string image(size > 0 ? static_cast<std::size_t>(size) : 0, '\0');
    if (size <= 0 || H5Fget_file_image(file.get(), image.data(), image.size()) != size)
        throw std::runtime_error("cannot read back the HDF5 image of the bases");
    return image;
}

int64_t kv_bases_numbers(const KvBases& bases) {
    int64_t numbers = 0;
    for (const auto* list : {&bases.key, &bases.value, &bases.joint_key, &bases.joint_value})
        for (const PcaBasis& b : *list) numbers += b.vectors.size() + b.energy.size() + b.mean.size();
    for (const Eigen::MatrixXd& m : bases.head_distance) numbers += m.size();
    return numbers;
}

std::string kv_bases_file(const KvBases& bases, KvBasesFormat format) {
    return format == KvBasesFormat::hdf5 ? kv_bases_hdf5(bases) : kv_bases_json(bases);
}


std::string kv_bases_json(const KvBases& bases) {
    Json heads = Json::array(), joint = Json::array(), distance = Json::array();
    for (std::size_t u = 0; u < bases.key.size(); ++u)
        heads.push_back(Json{{"layer", u / bases.num_kv_heads},
                             {"kv_head", u % bases.num_kv_heads},
                             {"key", basis_json(bases.key[u])},
                             {"value", basis_json(bases.value[u])}});
    for (int layer = 0; layer < bases.num_layers; ++layer) {
        if (!bases.joint_key.empty())
            joint.push_back(Json{{"key", basis_json(bases.joint_key[layer])}, {"value", basis_json(bases.joint_value[layer])}});
        Json rows = Json::array();
        for (int a = 0; a < bases.num_kv_heads; ++a) {
            Json row = Json::array();
            for (int b = 0; b < bases.num_kv_heads; ++b) row.push_back(bases.head_distance[layer](a, b));
            rows.push_back(std::move(row));
        }
        distance.push_back(std::move(rows));
    }
    Json root{{"format", "kvsim-kv-bases"},
              {"version", 1},
              {"num_layers", bases.num_layers},
              {"num_kv_heads", bases.num_kv_heads},
              {"head_dim", bases.head_dim},
              {"keys", bases.keys},
              {"fitted_sequences", bases.fitted_sequences},
              {"heads", std::move(heads)},
              {"head_distance", std::move(distance)}};
    if (!bases.joint_key.empty()) root["joint"] = std::move(joint);
    if (bases.rope.known())
        root["rope"] = Json{{"pairing", to_string(bases.rope.pairing)}, {"frequencies", bases.rope.frequencies}};
    return root.dump() + "\n";
}

void write_kv_bases(const std::string& path, const KvBases& bases) {
    if (kv_bases_format_of(path) == KvBasesFormat::json) return write_file_atomically(path, kv_bases_json(bases));
    // Straight into the file (no image in memory: 303 MB at the 1B shape), published whole.
    silence_hdf5_here();
    AtomicFile out(path);
    {
        Hdf5Handle file(H5Fcreate(out.temp_path().c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
        if (!file.valid()) throw InputError(path + ": cannot create HDF5 file");
        write_kv_bases_hdf5(file.get(), bases);
    }
    out.commit();
}

std::shared_ptr<const KvBases> load_kv_bases(const std::string& path, int num_layers, int num_kv_heads, int head_dim) {
    // Every stream of a run reads the same file: parse it once per process.
    static std::mutex mutex;
    static std::map<std::string, std::shared_ptr<const KvBases>> cache;
    std::shared_ptr<const KvBases> bases;
    {
        std::lock_guard<std::mutex> lock(mutex);
        auto& slot = cache[path];
        if (!slot) slot = read_kv_bases(path);
        bases = slot;
    }
    if (bases->num_layers != num_layers || bases->num_kv_heads != num_kv_heads || bases->head_dim != head_dim)
        throw InputError(path + ": bases of " + std::to_string(bases->num_layers) + " layers x " +
                         std::to_string(bases->num_kv_heads) + " KV heads x head size " +
                         std::to_string(bases->head_dim) + ", but the trace has " + std::to_string(num_layers) +
                         " x " + std::to_string(num_kv_heads) + " x " + std::to_string(head_dim));
    return bases;
}

std::string fitted_ranks_json(const FittedRanks& ranks, int num_layers, int num_kv_heads, int head_dim) {
    Json root{{"format", "kvsim-ranks"},  {"version", 1},
              {"num_layers", num_layers}, {"num_kv_heads", num_kv_heads},
              {"head_dim", head_dim},     {"joint", ranks.joint},
              {"key_rank", ranks.key_rank}, {"value_rank", ranks.value_rank}};
    return root.dump(1) + "\n";
}

void write_fitted_ranks(const std::string& path, const FittedRanks& ranks, int num_layers, int num_kv_heads,
                        int head_dim) {
    write_file_atomically(path, fitted_ranks_json(ranks, num_layers, num_kv_heads, head_dim));
}

FittedRanks load_fitted_ranks(const std::string& path, int num_layers, int num_kv_heads, int head_dim) {
    const Json root = load_ordered_json_file(path);
    if (!root.is_object() || !root.contains("format") || root["format"] != "kvsim-ranks")
        throw InputError(path + ": 'format' is not kvsim-ranks (kvsim search writes ranks.json)");
    require_version_1(root, path);
    if (int_field(root, "num_layers", path) != num_layers || int_field(root, "num_kv_heads", path) != num_kv_heads ||
        int_field(root, "head_dim", path) != head_dim)
        throw InputError(path + ": ranks fitted to another shape than the trace's " + std::to_string(num_layers) +
                         " layers x " + std::to_string(num_kv_heads) + " KV heads x head size " +
                         std::to_string(head_dim));
    FittedRanks out;
    const auto joint = root.find("joint");
    if (joint == root.end() || !joint->is_boolean()) throw InputError(path + ": 'joint' missing or not true/false");
    out.joint = joint->get<bool>();
    const std::size_t units = out.joint ? num_layers : static_cast<std::size_t>(num_layers) * num_kv_heads;
    const int most = out.joint ? num_kv_heads * head_dim : head_dim;
    for (const char* key : {"key_rank", "value_rank"}) {
        const Json& list = list_field(root, key, units, path);
        std::vector<int>& to = std::string(key) == "key_rank" ? out.key_rank : out.value_rank;
        for (std::size_t u = 0; u < units; ++u) {
            const std::string at = path + ": " + key + "[" + std::to_string(u) + "]";
            if (!list[u].is_number_integer()) throw InputError(at + ": not an integer");
            // Checked whole, then narrowed: 2^32 + 5 is not rank 5.
            const bool in_range = !(list[u].is_number_unsigned() && list[u].get<uint64_t>() > static_cast<uint64_t>(most)) &&
                                  list[u].get<int64_t>() >= 1 && list[u].get<int64_t>() <= most;
            if (!in_range)
                throw InputError(at + ": " + std::string(key) + " = " + list[u].dump() + " must be in 1.." +
                                 std::to_string(most) + " (the trace's head size bounds a head's rank)");
            const int64_t rank = list[u].get<int64_t>();
            to.push_back(static_cast<int>(rank));
        }
    }
    return out;
}

std::vector<int> group_heads_of_layer(int num_kv_heads, int group_size, const Eigen::MatrixXd* distance) {
    std::vector<int> group(num_kv_heads, -1);
    int next = 0;
    for (int seed = 0; seed < num_kv_heads; ++seed) {
        if (group[seed] >= 0) continue;
        std::vector<int> members{seed};
        group[seed] = next;
        while (static_cast<int>(members.size()) < group_size) {
            int best = -1;
            double best_cost = 0;
            for (int h = 0; h < num_kv_heads; ++h) {
                if (group[h] >= 0) continue;
                double cost = 0;
                if (distance)
                    for (int m : members) cost += (*distance)(m, h);
                if (best < 0 || cost < best_cost) best = h, best_cost = cost;  // ties: the lowest head
            }
            if (best < 0) break;
            group[best] = next;
            members.push_back(best);
        }
        ++next;
    }
    return group;
}

std::vector<int> projection_groups(const KvProjection& p, int layer, int num_kv_heads) {
    const Eigen::MatrixXd* distance =
        p.fitted_groups && p.bases ? &p.bases->head_distance.at(layer) : nullptr;
    return group_heads_of_layer(num_kv_heads, p.group_size, distance);
}

int KvProjection::stored_key_dim(int layer, int kv, int head_dim) const {
    switch (kind) {
        case Kind::low_rank: return key_rank.at(static_cast<std::size_t>(layer) * bases->num_kv_heads + kv);
        case Kind::joint_low_rank: return key_rank.at(layer);
        case Kind::grouping: return head_dim;
    }
    return head_dim;
}

int KvProjection::stored_value_dim(int layer, int kv, int head_dim) const {
    switch (kind) {
        case Kind::low_rank: return value_rank.at(static_cast<std::size_t>(layer) * bases->num_kv_heads + kv);
        case Kind::joint_low_rank: return value_rank.at(layer);
        case Kind::grouping: return head_dim;
    }
    return head_dim;
}

double KvProjection::share(int num_kv_heads) const {
    switch (kind) {
        case Kind::low_rank: return 1.0;
        case Kind::joint_low_rank: return 1.0 / num_kv_heads;
        case Kind::grouping: return 1.0 / group_size;
    }
    return 1.0;
}

double KvProjection::basis_bytes(int layer, int kv, int num_kv_heads, int head_dim) const {
    // A rank-r up-projection is n x r numbers at fp16 plus the mean's n (n: the head size, or the
    // layer's width for a joint latent); a head at full rank stores its vectors as they are.
    const auto up = [](int n, int rank) { return rank >= n ? 0.0 : 2.0 * n * (rank + 1); };
    switch (kind) {
        case Kind::low_rank:
            return up(head_dim, stored_key_dim(layer, kv, head_dim)) + up(head_dim, stored_value_dim(layer, kv, head_dim));
        case Kind::joint_low_rank: {
            const int width = num_kv_heads * head_dim;
            return (up(width, key_rank.at(layer)) + up(width, value_rank.at(layer))) / num_kv_heads;
        }
        case Kind::grouping: return 0.0;
    }
    return 0.0;
}

std::string check_rank(int rank, int most, const std::string& what) {
    if (rank < 1 || rank > most)
        return what + " = " + std::to_string(rank) + " must be in 1.." + std::to_string(most) +
               (most > 0 ? " (the trace's head size bounds a head's rank)" : "");
    return {};
}

// Low-rank reconstruction in the bases' own frame (before RoPE for pre-RoPE keys).
static void reconstruct_unrotated(const KvProjection& p, int layer, int num_kv_heads, int head_dim, bool key,
                                  const float* latent, const float* original, float* out, int64_t count);

void project_tokens(const KvProjection& p, int layer, int num_kv_heads, int head_dim, bool key, const float* x,
                    float* latent, int64_t count, int64_t first_pos) {
    const int width = num_kv_heads * head_dim;
    std::vector<float> unrotated;
    if (key && p.kind != KvProjection::Kind::grouping && p.bases->rope.known()) {
        unrotated.assign(x, x + count * width);
        apply_rope_rows(unrotated.data(), first_pos, count, num_kv_heads, head_dim, p.bases->rope, true);
        x = unrotated.data();
    }
    std::fill(latent, latent + count * width, 0.0f);
    if (p.kind == KvProjection::Kind::grouping) {
        // Each head's slot holds its group's mean: the one K (or V) the group stores.
        const std::vector<int> group = projection_groups(p, layer, num_kv_heads);
        const int groups = *std::max_element(group.begin(), group.end()) + 1;
        std::vector<int> size(groups, 0);
        for (int g : group) ++size[g];
        std::vector<double> mean(static_cast<std::size_t>(groups) * head_dim);
        for (int64_t t = 0; t < count; ++t) {
            std::fill(mean.begin(), mean.end(), 0.0);
            const float* row = x + t * width;
            for (int h = 0; h < num_kv_heads; ++h)
                for (int i = 0; i < head_dim; ++i) mean[static_cast<std::size_t>(group[h]) * head_dim + i] += row[h * head_dim + i];
            for (int h = 0; h < num_kv_heads; ++h)
                for (int i = 0; i < head_dim; ++i)
                    latent[t * width + h * head_dim + i] =
                        static_cast<float>(mean[static_cast<std::size_t>(group[h]) * head_dim + i] / size[group[h]]);
        }
        return;
    }
    if (p.kind == KvProjection::Kind::joint_low_rank) {
        const PcaBasis& b = key ? p.bases->joint_key[layer] : p.bases->joint_value[layer];
        const int rank = key ? p.key_rank[layer] : p.value_rank[layer];
        const Eigen::MatrixXd down = b.vectors.leftCols(rank).transpose();
        for (int64_t t = 0; t < count; ++t) {
            const Eigen::VectorXd token = Eigen::Map<const Eigen::VectorXf>(x + t * width, width).cast<double>();
            Eigen::Map<Eigen::VectorXf>(latent + t * width, rank) = (down * (token - b.mean)).cast<float>();
        }
        return;
    }
    for (int kv = 0; kv < num_kv_heads; ++kv) {
        const std::size_t u = static_cast<std::size_t>(layer) * num_kv_heads + kv;
        const PcaBasis& b = key ? p.bases->key[u] : p.bases->value[u];
        const int rank = key ? p.key_rank[u] : p.value_rank[u];
        const Eigen::MatrixXd down = b.vectors.leftCols(rank).transpose();
        for (int64_t t = 0; t < count; ++t) {
            const int64_t at = t * width + static_cast<int64_t>(kv) * head_dim;
            const Eigen::VectorXd token = Eigen::Map<const Eigen::VectorXf>(x + at, head_dim).cast<double>();
            Eigen::Map<Eigen::VectorXf>(latent + at, rank) = (down * (token - b.mean)).cast<float>();
        }
    }
}

void reconstruct_tokens(const KvProjection& p, int layer, int num_kv_heads, int head_dim, bool key,
                        const float* latent, const float* original, float* out, int64_t count, int64_t first_pos) {
    const int width = num_kv_heads * head_dim;
    if (p.kind == KvProjection::Kind::grouping) {  // the slots already hold what each head reads
        std::copy(latent, latent + count * width, out);
        return;
    }
    if (key && p.bases->rope.known()) {  // pre-RoPE bases: reconstruct, then rotate into place
        reconstruct_unrotated(p, layer, num_kv_heads, head_dim, key, latent, nullptr, out, count);
        apply_rope_rows(out, first_pos, count, num_kv_heads, head_dim, p.bases->rope, false);
        if (!original) return;
        // A head at full rank keeps its recorded keys, exactly.
        const bool joint = p.kind == KvProjection::Kind::joint_low_rank;
        for (int kv = 0; kv < num_kv_heads; ++kv) {
            const int rank = joint ? p.key_rank[layer] : p.key_rank[static_cast<std::size_t>(layer) * num_kv_heads + kv];
            if (rank < (joint ? width : head_dim)) continue;
            for (int64_t t = 0; t < count; ++t) {
                const int64_t at = t * width + static_cast<int64_t>(kv) * head_dim;
                std::copy(original + at, original + at + head_dim, out + at);
            }
        }
        return;
    }
    reconstruct_unrotated(p, layer, num_kv_heads, head_dim, key, latent, original, out, count);
}

static void reconstruct_unrotated(const KvProjection& p, int layer, int num_kv_heads, int head_dim, bool key,
                                  const float* latent, const float* original, float* out, int64_t count) {
    const int width = num_kv_heads * head_dim;
    if (p.kind == KvProjection::Kind::joint_low_rank) {
        const int rank = key ? p.key_rank[layer] : p.value_rank[layer];
        if (original && rank >= width) {
            std::copy(original, original + count * width, out);
            return;
        }
        const PcaBasis& b = key ? p.bases->joint_key[layer] : p.bases->joint_value[layer];
        const Eigen::MatrixXd up = b.vectors.leftCols(rank);
        for (int64_t t = 0; t < count; ++t) {
            const Eigen::VectorXd c = Eigen::Map<const Eigen::VectorXf>(latent + t * width, rank).cast<double>();
            Eigen::Map<Eigen::VectorXf>(out + t * width, width) = (b.mean + up * c).cast<float>();
        }
        return;
    }
    for (int kv = 0; kv < num_kv_heads; ++kv) {
        const std::size_t u = static_cast<std::size_t>(layer) * num_kv_heads + kv;
        const int rank = key ? p.key_rank[u] : p.value_rank[u];
        const PcaBasis& b = key ? p.bases->key[u] : p.bases->value[u];
        const Eigen::MatrixXd up = b.vectors.leftCols(rank);
        for (int64_t t = 0; t < count; ++t) {
            const int64_t at = t * width + static_cast<int64_t>(kv) * head_dim;
            if (original && rank >= head_dim) {
                std::copy(original + at, original + at + head_dim, out + at);
                continue;
            }
            const Eigen::VectorXd c = Eigen::Map<const Eigen::VectorXf>(latent + at, rank).cast<double>();
            Eigen::Map<Eigen::VectorXf>(out + at, head_dim) = (b.mean + up * c).cast<float>();
        }
    }
}

void project_layer(const KvProjection& p, int layer, const QkvLayer& data, int num_kv_heads, int head_dim,
                   std::vector<float>& key_latent, std::vector<float>& value_latent) {
    key_latent.resize(data.k.size());
    value_latent.resize(data.v.size());
    project_tokens(p, layer, num_kv_heads, head_dim, true, data.k.data(), key_latent.data(), data.tokens);
    project_tokens(p, layer, num_kv_heads, head_dim, false, data.v.data(), value_latent.data(), data.tokens);
}

void reconstruct_layer(const KvProjection& p, int layer, int64_t tokens, int num_kv_heads, int head_dim,
                       const std::vector<float>& key_latent, const std::vector<float>& value_latent,
                       std::vector<float>& key_out, std::vector<float>& value_out) {
    key_out.resize(key_latent.size());
    value_out.resize(value_latent.size());
    reconstruct_tokens(p, layer, num_kv_heads, head_dim, true, key_latent.data(), nullptr, key_out.data(), tokens);
    reconstruct_tokens(p, layer, num_kv_heads, head_dim, false, value_latent.data(), nullptr, value_out.data(), tokens);
}

void build_projected_arrays(const KvProjection& p, int layer, const QkvLayer& data, int num_kv_heads, int head_dim,
                            const TierFormat* format, TierArrays& arrays) {
    QkvLayer latent;
    latent.tokens = data.tokens;
    project_layer(p, layer, data, num_kv_heads, head_dim, latent.k, latent.v);
    const int64_t n = data.tokens;
    if (format) {
        // The cache quantises what it stores, the latents (a group's one K and V; a joint latent
        // is one vector per token of the layer's width), then reconstructs from them.
        const bool joint = p.kind == KvProjection::Kind::joint_low_rank;
        TierArrays latent_tiers;
        latent_tiers.format = *format;
        build_tier_arrays(latent, joint ? 1 : num_kv_heads, joint ? num_kv_heads * head_dim : head_dim, latent_tiers);
        arrays.format = *format;
        for (auto [from, to, key] : {std::tuple{&latent_tiers.storage_k8, &arrays.storage_k8, true},
                                     std::tuple{&latent_tiers.storage_v8, &arrays.storage_v8, false},
                                     std::tuple{&latent_tiers.storage_k4, &arrays.storage_k4, true},
                                     std::tuple{&latent_tiers.storage_v4, &arrays.storage_v4, false}}) {
            to->resize(from->size());
            reconstruct_tokens(p, layer, num_kv_heads, head_dim, key, from->data(), nullptr, to->data(), n);
        }
        arrays.k[1] = arrays.storage_k8.data();
        arrays.v[1] = arrays.storage_v8.data();
        arrays.k[2] = arrays.storage_k4.data();
        arrays.v[2] = arrays.storage_v4.data();
    }
    // At fp16, a head kept at full rank stores its own vectors (a rotation saves nothing): its
    // reconstruction is the trace's, exactly.
    arrays.storage_k16.resize(data.k.size());
    arrays.storage_v16.resize(data.v.size());
    reconstruct_tokens(p, layer, num_kv_heads, head_dim, true, latent.k.data(), data.k.data(), arrays.storage_k16.data(), n);
    reconstruct_tokens(p, layer, num_kv_heads, head_dim, false, latent.v.data(), data.v.data(), arrays.storage_v16.data(), n);
    arrays.k[0] = arrays.storage_k16.data();
    arrays.v[0] = arrays.storage_v16.data();
}

}  // namespace kvsim
