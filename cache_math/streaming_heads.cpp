// Streaming heads: exact sinks + recent window, everything else in a decayed linear state.
// The formulas and the decay rule are stated in streaming_heads.h.
#include "cache_math/streaming_heads.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "base/yaml_file.h"
#include "base/errors.h"
#include "base/input_file.h"

namespace kvsim {

namespace {

std::string format_number(double x) {
    std::ostringstream os;
    os << x;
    return os.str();
}

void check_lambda(double lambda) {
    // NaN fails both comparisons, so it is rejected too.
    if (!(lambda >= 0.0 && lambda <= 1.0))
        throw InputError("streaming heads: lambda must be in [0, 1], got " + format_number(lambda));
}

}  // namespace

void validate_streaming_params(const StreamingHeadParams& params) {
    if (params.sinks < 0)
        throw InputError("streaming heads: sinks must be >= 0, got " + std::to_string(params.sinks));
    if (params.recent < 0)
        throw InputError("streaming heads: recent must be >= 0, got " + std::to_string(params.recent));
    check_lambda(params.lambda);
}

// ---------------------------------------------------------------------------------------------
// StreamingHeadState

StreamingHeadState::StreamingHeadState(int head_dim, const StreamingHeadParams& params)
    : dim_(head_dim), params_(params) {
    if (head_dim < 1) throw std::invalid_argument("StreamingHeadState: head_dim must be >= 1");
    validate_streaming_params(params);
    state_ = Eigen::MatrixXd::Zero(dim_, dim_);
    normaliser_ = Eigen::VectorXd::Zero(dim_);
    sink_keys_.resize(dim_, params.sinks);
    sink_values_.resize(dim_, params.sinks);
    sink_positions_.reserve(params.sinks);
    recent_keys_.resize(dim_, params.recent);
    recent_values_.resize(dim_, params.recent);
    sink_phi_.resize(dim_, params.sinks);
    recent_phi_.resize(dim_, params.recent);
    recent_positions_.assign(params.recent, -1);
    for (Eigen::VectorXd* v : {&query_, &phi_q_, &linear_num_, &key_, &softmax_acc_, &phi_k_}) v->resize(dim_);
    scores_.reserve(static_cast<std::size_t>(params.sinks) + params.recent);
}

void StreamingHeadState::fold(const Eigen::Ref<const Eigen::VectorXd>& phi_k, const float* v) {
    const Eigen::Map<const Eigen::VectorXf> value(v, dim_);
    state_.noalias() += phi_k * value.cast<double>().transpose();  // rank-1: S += phi(k) v^T
    normaliser_ += phi_k;
    ++folded_;
}

void StreamingHeadState::admit(int64_t t, const float* k, const float* v) {
    if (t <= last_position_)
        throw std::invalid_argument("StreamingHeadState::admit: position " + std::to_string(t) + " after " +
                                    std::to_string(last_position_) + "; positions must increase");
    // Decay first, once per step since the last admit, so a token folded at this step enters with
    // weight 1. An empty state needs no decay, and lambda = 1 is exact without the multiply.
    if (folded_ > 0 && params_.lambda != 1.0) {
        const double decay = std::pow(params_.lambda, static_cast<double>(t - last_position_));
        state_ *= decay;
        normaliser_ *= decay;
    }
    last_position_ = t;

    const Eigen::Map<const Eigen::VectorXf> key(k, dim_), value(v, dim_);
    Eigen::VectorXd& phi_k = phi_k_;
    phi_k = key.cast<double>().unaryExpr(&streaming_feature);
    if (static_cast<int>(sink_positions_.size()) < params_.sinks) {
        const int slot = static_cast<int>(sink_positions_.size());
        sink_keys_.col(slot) = key;
        sink_values_.col(slot) = value;
        sink_phi_.col(slot) = phi_k;
        sink_positions_.push_back(t);
        return;
    }
    if (params_.recent == 0) {  // no window: the token goes straight into the state
        fold(phi_k, v);
        return;
    }
    int slot;
    if (recent_count_ == params_.recent) {
        // The oldest recent token leaves the window now; its slot takes the new token.
        slot = recent_head_;
        fold(recent_phi_.col(slot), recent_values_.col(slot).data());
        recent_head_ = (recent_head_ + 1) % params_.recent;
    } else {
        slot = (recent_head_ + recent_count_) % params_.recent;
        ++recent_count_;
    }
    recent_keys_.col(slot) = key;
    recent_values_.col(slot) = value;
    recent_phi_.col(slot) = phi_k;
    recent_positions_[slot] = t;
}

void StreamingHeadState::output(const float* q, float* out) const {
    Eigen::VectorXd &query = query_, &phi_q = phi_q_, &linear_num = linear_num_;
    query = Eigen::Map<const Eigen::VectorXf>(q, dim_).cast<double>();
    phi_q = query.unaryExpr(&streaming_feature);
    linear_num.noalias() = state_.transpose() * phi_q;  // S^T phi(q)
    const double linear_den = normaliser_.dot(phi_q);               // z . phi(q)
    Eigen::Map<Eigen::VectorXf> result(out, dim_);

    const int n_sinks = static_cast<int>(sink_positions_.size());
    const int n_exact = n_sinks + recent_count_;
    if (n_exact == 0) {
        result = (linear_num / std::max(linear_den, kLinearEps)).cast<float>();
        return;
    }
    auto key_of = [&](int i) {
        return i < n_sinks ? sink_keys_.col(i) : recent_keys_.col((recent_head_ + i - n_sinks) % params_.recent);
    };
    auto phi_of = [&](int i) {
        return i < n_sinks ? sink_phi_.col(i) : recent_phi_.col((recent_head_ + i - n_sinks) % params_.recent);
    };
    auto value_of = [&](int i) {
        return i < n_sinks ? sink_values_.col(i) : recent_values_.col((recent_head_ + i - n_sinks) % params_.recent);
    };

    // Softmax among the exact tokens (max-subtracted), and their kernel mass K_E.
    const double inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(dim_));
    std::vector<double>& scores = scores_;
    scores.assign(n_exact, 0.0);
    double kernel_mass = 0.0;
    for (int i = 0; i < n_exact; ++i) {
        Eigen::VectorXd& key = key_;
        key = key_of(i).cast<double>();
        scores[i] = query.dot(key) * inv_sqrt_d;
        Eigen::VectorXd& phi_k = phi_k_;
        phi_k = phi_of(i);  // aligned, as the vectors the dot product was written against
        kernel_mass += phi_q.dot(phi_k);
    }
    const double max_score = *std::max_element(scores.begin(), scores.end());
    Eigen::VectorXd& softmax_acc = softmax_acc_;
    softmax_acc.setZero();
    double softmax_sum = 0.0;
    for (int i = 0; i < n_exact; ++i) {
        const double w = std::exp(scores[i] - max_score);
        softmax_sum += w;
        softmax_acc += w * value_of(i).cast<double>();
    }
    // K_E > 0 because phi > 0, so the denominator never vanishes here.
    result = ((kernel_mass * (softmax_acc / softmax_sum) + linear_num) / (kernel_mass + linear_den)).cast<float>();
}

std::vector<int64_t> StreamingHeadState::exact_positions() const {
    std::vector<int64_t> positions(sink_positions_);
    for (int i = 0; i < recent_count_; ++i)
        positions.push_back(recent_positions_[(recent_head_ + i) % params_.recent]);
    return positions;
}

double StreamingHeadState::bytes() const {
    const double exact_tokens = static_cast<double>(sink_positions_.size()) + recent_count_;
    const double d = dim_;
    return exact_tokens * 4.0 * d + 4.0 * (d * d + d);
}

// ---------------------------------------------------------------------------------------------
// StreamingPlan

namespace {

std::size_t plan_index(const StreamingPlan& plan, int layer, int kv) {
    if (layer < 0 || layer >= plan.num_layers || kv < 0 || kv >= plan.num_kv_heads)
        throw std::out_of_range("StreamingPlan: (layer " + std::to_string(layer) + ", KV head " +
                                std::to_string(kv) + ") outside " + std::to_string(plan.num_layers) + " x " +
                                std::to_string(plan.num_kv_heads));
    return static_cast<std::size_t>(layer) * plan.num_kv_heads + kv;
}

std::string count_of(std::size_t n, const std::string& singular, const std::string& plural) {
    return std::to_string(n) + " " + (n == 1 ? singular : plural);
}

bool is_blank(const std::string& s) { return s.find_first_not_of(" \t\r\v\f") == std::string::npos; }

std::string trim(const std::string& s, const char* whitespace) {
    const auto first = s.find_first_not_of(whitespace);
    if (first == std::string::npos) return {};
    const auto last = s.find_last_not_of(whitespace);
    return s.substr(first, last - first + 1);
}

}  // namespace

bool StreamingPlan::is_streaming(int layer, int kv) const { return streaming[plan_index(*this, layer, kv)] != 0; }

double StreamingPlan::lambda_of(int layer, int kv) const { return lambda[plan_index(*this, layer, kv)]; }

bool StreamingPlan::is_stateless(int layer, int kv) const {
    const std::size_t i = plan_index(*this, layer, kv);
    return !stateless.empty() && stateless.at(i) != 0;
}

int64_t StreamingPlan::streaming_count() const {
    return std::count_if(streaming.begin(), streaming.end(), [](uint8_t s) { return s != 0; });
}

// ---------------------------------------------------------------------------------------------
// DuoAttention pattern files

namespace {

StreamingPlan parse_streaming_profile(const std::string& text, const std::string& path, int num_layers,
                                      int num_kv_heads, double default_lambda) {
    const YAML::Node file = load_yaml_text(text, path);
    auto fail = [&](const std::string& what) -> void { throw InputError(path + ": " + what); };
    // A kvsim profile.json (JSON is YAML) keeps the same rows under streaming.heads and .lambda.
    const bool profile_json = file.IsMap() && file["format"] && file["streaming"] && file["streaming"].IsMap();
    const YAML::Node root = profile_json ? file["streaming"] : file;
    const char* rows_key = profile_json ? "heads" : "streaming";
    if (!root.IsMap() || !root[rows_key]) fail("missing key 'streaming' (one row of 0/1 per layer)");
    const YAML::Node rows = root[rows_key];
    if (!rows.IsSequence() || static_cast<int>(rows.size()) != num_layers)
        fail("streaming: " + std::to_string(rows.IsSequence() ? rows.size() : 0) + " rows, but the trace has " +
             std::to_string(num_layers) + " layers");
    StreamingPlan plan;
    plan.num_layers = num_layers;
    plan.num_kv_heads = num_kv_heads;
    plan.streaming.assign(static_cast<std::size_t>(num_layers) * num_kv_heads, 0);
    plan.lambda.assign(plan.streaming.size(), default_lambda);
    auto number = [&](const YAML::Node& n, const std::string& key) {
        double v = 0;
        if (!n.IsScalar() || !YAML::convert<double>::decode(n, v) || !std::isfinite(v))
            fail(key + ": expected a number");
        return v;
    };
    // One row of 0/1 per layer, `name` in messages.
    auto gates = [&](const YAML::Node& table, const std::string& name, std::vector<uint8_t>& out) {
        if (!table.IsSequence() || static_cast<int>(table.size()) != num_layers)
            fail(name + ": " + std::to_string(table.IsSequence() ? table.size() : 0) + " rows, but the trace has " +
                 std::to_string(num_layers) + " layers");
        out.assign(static_cast<std::size_t>(num_layers) * num_kv_heads, 0);
        for (int l = 0; l < num_layers; ++l) {
            const YAML::Node row = table[l];
            if (!row.IsSequence() || static_cast<int>(row.size()) != num_kv_heads)
                fail(name + "[" + std::to_string(l) + "]: " + std::to_string(row.IsSequence() ? row.size() : 0) +
                     " entries, but the trace has " + std::to_string(num_kv_heads) + " KV heads");
            for (int g = 0; g < num_kv_heads; ++g) {
                const std::string key = name + "[" + std::to_string(l) + "][" + std::to_string(g) + "]";
                const double v = number(row[g], key);
                if (v != 0 && v != 1) fail(key + ": expected 0 or 1");
                out[static_cast<std::size_t>(l) * num_kv_heads + g] = static_cast<uint8_t>(v);
            }
        }
    };
    gates(rows, "streaming", plan.streaming);
    if (const YAML::Node stateless = root["stateless"]) gates(stateless, "stateless", plan.stateless);
    if (const YAML::Node lambda = root["lambda"]) {
        auto set = [&](std::size_t i, const YAML::Node& n, const std::string& key) {
            const double v = number(n, key);
            if (v < 0 || v > 1) fail(key + ": " + std::to_string(v) + " is outside [0, 1]");
            plan.lambda[i] = v;
        };
        if (lambda.IsScalar()) {
            for (std::size_t i = 0; i < plan.lambda.size(); ++i) set(i, lambda, "lambda");
        } else {
            if (!lambda.IsSequence() || static_cast<int>(lambda.size()) != num_layers)
                fail("lambda: expected one number, or one row per layer (" + std::to_string(num_layers) + ")");
            for (int l = 0; l < num_layers; ++l) {
                if (!lambda[l].IsSequence() || static_cast<int>(lambda[l].size()) != num_kv_heads)
                    fail("lambda[" + std::to_string(l) + "]: expected " + std::to_string(num_kv_heads) + " values");
                for (int g = 0; g < num_kv_heads; ++g)
                    set(static_cast<std::size_t>(l) * num_kv_heads + g, lambda[l][g],
                        "lambda[" + std::to_string(l) + "][" + std::to_string(g) + "]");
            }
        }
    }
    return plan;
}

}  // namespace

StreamingPlan load_streaming_profile(const std::string& path, int num_layers, int num_kv_heads,
                                     double default_lambda) {
    char key[64];
    std::snprintf(key, sizeof key, "%dx%d lambda %a", num_layers, num_kv_heads, default_lambda);
    return parsed_once<StreamingPlan>(path, key, [&](const std::string& text) {
        return parse_streaming_profile(text, path, num_layers, num_kv_heads, default_lambda);
    });
}

std::vector<double> load_duo_attention_gates(const std::string& path, int num_layers, int num_kv_heads) {
    if (num_layers < 1 || num_kv_heads < 1)
        throw std::invalid_argument("load_duo_attention_gates: the model needs >= 1 layer and KV head");

    require_regular_file(path);
    std::ifstream in(path);
    if (!in) throw InputError(path + ": cannot be opened for reading");

    std::vector<std::string> lines;
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    if (in.bad()) throw InputError(path + ": read error");
    while (!lines.empty() && is_blank(lines.back())) lines.pop_back();

    std::vector<double> all_gates;
    all_gates.reserve(static_cast<std::size_t>(num_layers) * num_kv_heads);

    // Rows are checked in file order, cells before the row's count, so a header row or a stray
    // word is reported where it is rather than as a count mismatch.
    for (std::size_t r = 0; r < lines.size(); ++r) {
        const std::string row = trim(lines[r], " \t\r\v\f");  // numpy's savetxt writes no trailing tab
        const std::string where = path + ": row " + std::to_string(r + 1);
        std::vector<double> gates;
        std::size_t start = 0;
        while (!row.empty()) {
            const std::size_t tab = row.find('\t', start);
            const std::string cell = trim(row.substr(start, tab == std::string::npos ? std::string::npos : tab - start), " \r\v\f");
            double value = 0.0;
            const char* begin = cell.data();
            const char* end = begin + cell.size();
            const auto [ptr, err] = std::from_chars(begin, end, value);
            if (cell.empty() || err != std::errc() || ptr != end || std::isnan(value))
                throw InputError(where + ", column " + std::to_string(gates.size() + 1) + ": '" + cell +
                                 "' is not a number");
            if (!std::isfinite(value))
                throw InputError(where + ", column " + std::to_string(gates.size() + 1) + ": '" + cell +
                                 "' is not a finite number");
            gates.push_back(value);
            if (tab == std::string::npos) break;
            start = tab + 1;
        }
        if (static_cast<int>(gates.size()) != num_kv_heads)
            throw InputError(where + " has " + count_of(gates.size(), "gate", "gates") + ", but the trace has " +
                             count_of(num_kv_heads, "KV head", "KV heads"));
        if (static_cast<int>(r) < num_layers) all_gates.insert(all_gates.end(), gates.begin(), gates.end());
    }
    if (static_cast<int>(lines.size()) != num_layers)
        throw InputError(path + ": " + count_of(lines.size(), "row", "rows") + ", but the trace has " +
                         count_of(num_layers, "layer", "layers"));
    return all_gates;
}

StreamingPlan load_duo_attention_pattern(const std::string& path, int num_layers, int num_kv_heads,
                                         double default_lambda, double threshold) {
    check_lambda(default_lambda);
    StreamingPlan plan;
    plan.num_layers = num_layers;
    plan.num_kv_heads = num_kv_heads;
    for (double g : load_duo_attention_gates(path, num_layers, num_kv_heads)) plan.streaming.push_back(g > threshold ? 0 : 1);
    plan.lambda.assign(plan.streaming.size(), default_lambda);
    return plan;
}

}  // namespace kvsim
