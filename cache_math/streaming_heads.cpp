// Streaming heads: exact sinks + recent window, everything else in a decayed linear state.
// The formulas and the decay rule are stated in streaming_heads.h.
#include "cache_math/streaming_heads.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>
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

namespace {

using Packet = Eigen::Array<double, 8, 1>;

// f of n doubles, eight at a time; the tail padded through the same arithmetic, so that an
// element's bits depend on its value alone, not on where it lies.
template <class F>
void eight_at_a_time(const double* x, double* out, std::size_t n, F f) {
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) Eigen::Map<Packet>(out + i) = f(Eigen::Map<const Packet>(x + i));
    if (i < n) {
        Packet tail = Packet::Zero();
        std::copy(x + i, x + n, tail.data());
        const Packet result = f(tail);
        std::copy(result.data(), result.data() + (n - i), out + i);
    }
}

// out.col(g) = a * b.col(g) for every g, a read once per four queries: a's columns are walked
// in blocks of 16 rows, each row block's four queries' sums in registers (16 independent sums,
// so the multiply-adds do not wait on each other). No packing copy and no allocation, unlike a
// general matrix product: output() runs at every decode step of the runtime.
template <int Queries>
void multiply_block(const double* __restrict a, std::ptrdiff_t lda, int rows, int inner, const double* __restrict b,
                    std::ptrdiff_t ldb, double* __restrict out, std::ptrdiff_t ldo) {
    typedef double Lanes __attribute__((vector_size(64)));  // 8 doubles: one AVX-512 register
    auto load = [](const double* p) {
        Lanes v;
        std::memcpy(&v, p, sizeof v);
        return v;
    };
    int r = 0;
    for (; r + 16 <= rows; r += 16) {
        Lanes sums[Queries][2] = {};
        for (int k = 0; k < inner; ++k) {
            const Lanes low = load(a + k * lda + r), high = load(a + k * lda + r + 8);
            for (int g = 0; g < Queries; ++g) {
                const double x = b[g * ldb + k];
                sums[g][0] += low * x;
                sums[g][1] += high * x;
            }
        }
        for (int g = 0; g < Queries; ++g) {
            std::memcpy(out + g * ldo + r, &sums[g][0], sizeof(Lanes));
            std::memcpy(out + g * ldo + r + 8, &sums[g][1], sizeof(Lanes));
        }
    }
    for (; r < rows; ++r)  // the last rows, in the same order: k ascending
        for (int g = 0; g < Queries; ++g) {
            double sum = 0.0;
            for (int k = 0; k < inner; ++k) sum += a[k * lda + r] * b[g * ldb + k];
            out[g * ldo + r] = sum;
        }
}

// Sums in index order: Eigen's vector reductions start where the data is aligned, so a column's
// sum would depend on where in its matrix it lies (which query of the group it is).
double ordered_dot(const double* a, const double* b, int n) {
    double sum = 0.0;
    for (int i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

double ordered_sum(const double* a, int n) {
    double sum = 0.0;
    for (int i = 0; i < n; ++i) sum += a[i];
    return sum;
}

// out(:, g) = a * b(:, g) for each of b's columns; out's columns `ldo` apart.
void multiply_columns(const Eigen::Ref<const Eigen::MatrixXd>& a, const Eigen::Ref<const Eigen::MatrixXd>& b,
                      double* out, std::ptrdiff_t ldo) {
    const int rows = static_cast<int>(a.rows()), inner = static_cast<int>(a.cols()), queries = static_cast<int>(b.cols());
    for (int g = 0; g < queries; g += 4) {
        const double* in = b.data() + static_cast<std::ptrdiff_t>(g) * b.outerStride();
        double* to = out + static_cast<std::ptrdiff_t>(g) * ldo;
        switch (std::min(4, queries - g)) {
            case 4: multiply_block<4>(a.data(), a.outerStride(), rows, inner, in, b.outerStride(), to, ldo); break;
            case 3: multiply_block<3>(a.data(), a.outerStride(), rows, inner, in, b.outerStride(), to, ldo); break;
            case 2: multiply_block<2>(a.data(), a.outerStride(), rows, inner, in, b.outerStride(), to, ldo); break;
            default: multiply_block<1>(a.data(), a.outerStride(), rows, inner, in, b.outerStride(), to, ldo); break;
        }
    }
}

}  // namespace

void streaming_features(const double* x, double* phi, std::size_t n) {
    eight_at_a_time(x, phi, n, [](const Packet& in) -> Packet { return in.min(0.0).exp() + in.max(0.0); });
}

StreamingHeadState::StreamingHeadState(int head_dim, const StreamingHeadParams& params)
    : dim_(head_dim), params_(params) {
    if (head_dim < 1) throw std::invalid_argument("StreamingHeadState: head_dim must be >= 1");
    validate_streaming_params(params);
    state_transposed_ = Eigen::MatrixXd::Zero(dim_, dim_);
    normaliser_ = Eigen::VectorXd::Zero(dim_);
    const int slots = params.sinks + params.recent;
    exact_keys_.resize(slots, dim_);
    exact_values_.resize(dim_, slots);
    exact_phi_.resize(dim_, slots);
    exact_positions_.assign(slots, -1);
    waiting_phi_.resize(dim_, kMaxWaiting);
    waiting_values_.resize(dim_, kMaxWaiting);
    waiting_steps_.assign(kMaxWaiting, 0);
    key_.resize(dim_, 1);
    phi_key_.resize(dim_, 1);
    phi_sum_.resize(dim_);
}

void StreamingHeadState::admit(int64_t t, const float* k, const float* v) {
    if (t <= last_position_)
        throw std::invalid_argument("StreamingHeadState::admit: position " + std::to_string(t) + " after " +
                                    std::to_string(last_position_) + "; positions must increase");
    last_position_ = t;
    const Eigen::Map<const Eigen::VectorXf> key(k, dim_), value(v, dim_);
    key_.col(0) = key.cast<double>().array();
    streaming_features(key_.data(), phi_key_.data(), static_cast<std::size_t>(dim_));
    auto fold = [&](const auto& phi_k, const auto& value_k) {  // waits beside the state until read
        waiting_phi_.col(waiting_) = phi_k;
        waiting_values_.col(waiting_) = value_k;
        waiting_steps_[waiting_] = t;
        ++waiting_;
        ++folded_;
    };
    int slot;  // the slot the new token takes
    if (sink_count_ < params_.sinks) {
        slot = sink_count_++;
    } else if (params_.recent == 0) {  // no window: the token goes straight into the state
        fold(phi_key_.col(0).matrix(), value.cast<double>());
        if (waiting_ == kMaxWaiting) enter_waiting();
        return;
    } else if (recent_count_ == params_.recent) {
        // The oldest recent token leaves the window now; its slot takes the new token.
        slot = params_.sinks + recent_head_;
        fold(exact_phi_.col(slot), exact_values_.col(slot));
        recent_head_ = (recent_head_ + 1) % params_.recent;
    } else {
        slot = params_.sinks + (recent_head_ + recent_count_) % params_.recent;
        ++recent_count_;
    }
    exact_keys_.row(slot) = key_.col(0).matrix().transpose();
    exact_values_.col(slot) = value.cast<double>();
    exact_phi_.col(slot) = phi_key_.col(0).matrix();
    exact_positions_[slot] = t;
    if (waiting_ == kMaxWaiting) enter_waiting();
}

void StreamingHeadState::enter_waiting() {
    const int64_t now = last_position_;
    const bool decays = entered_ > 0 && params_.lambda != 1.0 && now != state_step_;
    const double decay = decays ? std::pow(params_.lambda, static_cast<double>(now - state_step_)) : 1.0;
    state_step_ = now;
    if (decays) normaliser_ *= decay;
    if (waiting_ == 0) {
        if (decays) state_transposed_ *= decay;
        return;
    }
    // Each waiting token at its decay since its fold (1 for one folded at this step).
    for (int j = 0; j < waiting_; ++j)
        if (waiting_steps_[j] != now && params_.lambda != 1.0)
            waiting_phi_.col(j) *= std::pow(params_.lambda, static_cast<double>(now - waiting_steps_[j]));
    // S += phi(k) v^T, so S^T += v phi(k)^T: one token (every step read) in the decay's own pass
    // over S; more as one matrix product after it.
    if (waiting_ == 1) {
        const auto value = waiting_values_.col(0);
        for (int k = 0; k < dim_; ++k)
            state_transposed_.col(k) = state_transposed_.col(k) * decay + waiting_phi_(k, 0) * value;
    } else {
        if (decays) state_transposed_ *= decay;
        state_transposed_.noalias() += waiting_values_.leftCols(waiting_) * waiting_phi_.leftCols(waiting_).transpose();
    }
    for (int j = 0; j < waiting_; ++j) normaliser_ += waiting_phi_.col(j);
    entered_ += waiting_;
    waiting_ = 0;
}

Eigen::MatrixXd StreamingHeadState::state_matrix() {
    enter_waiting();
    return state_transposed_.transpose();
}

const Eigen::VectorXd& StreamingHeadState::state_normaliser() {
    enter_waiting();
    return normaliser_;
}

void StreamingHeadState::output(std::span<const float* const> queries, float* out) {
    const int d = dim_, group = static_cast<int>(queries.size());
    enter_waiting();
    if (queries_.cols() != group) {  // sized once per group size (every exact slot's score)
        for (Eigen::MatrixXd* m : {&queries_, &phi_queries_, &linear_num_, &softmax_acc_}) m->resize(d, group);
        scores_.resize(exact_keys_.rows(), group);
        weights_.resize(exact_keys_.rows(), group);
    }
    for (int g = 0; g < group; ++g) queries_.col(g) = Eigen::Map<const Eigen::VectorXf>(queries[g], d).cast<double>();
    streaming_features(queries_.data(), phi_queries_.data(), static_cast<std::size_t>(d) * group);
    multiply_columns(state_transposed_, phi_queries_, linear_num_.data(), d);  // S^T phi(q)

    const int n_exact = sink_count_ + recent_count_;  // the first n_exact slots (see exact_keys_)
    if (n_exact == 0) {
        for (int g = 0; g < group; ++g) {
            const double linear_den = ordered_dot(normaliser_.data(), phi_queries_.col(g).data(), d);
            Eigen::Map<Eigen::VectorXf>(out + static_cast<std::size_t>(g) * d, d) =
                (linear_num_.col(g) / std::max(linear_den, kLinearEps)).cast<float>();
        }
        return;
    }
    // Scores against the exact keys (the first n_exact rows of scores_), and their phi summed for
    // the kernel masses.
    const std::ptrdiff_t slots = scores_.rows();
    multiply_columns(exact_keys_.topRows(n_exact), queries_, scores_.data(), slots);
    scores_.topRows(n_exact) *= 1.0 / std::sqrt(static_cast<double>(d));
    phi_sum_.setZero();
    for (int j = 0; j < n_exact; ++j) phi_sum_ += exact_phi_.col(j);
    // Softmax among the exact tokens (max-subtracted).
    for (int g = 0; g < group; ++g) {
        const double max_score = scores_.col(g).head(n_exact).maxCoeff();
        eight_at_a_time(scores_.col(g).data(), weights_.col(g).data(), static_cast<std::size_t>(n_exact),
                        [max_score](const Packet& in) -> Packet { return (in - max_score).exp(); });
    }
    multiply_columns(exact_values_.leftCols(n_exact), weights_.topRows(n_exact), softmax_acc_.data(), d);
    for (int g = 0; g < group; ++g) {
        const double kernel_mass = ordered_dot(phi_sum_.data(), phi_queries_.col(g).data(), d);
        const double linear_den = ordered_dot(normaliser_.data(), phi_queries_.col(g).data(), d);
        const double softmax_sum = ordered_sum(weights_.col(g).data(), n_exact);
        // K_E > 0 because phi > 0, so the denominator never vanishes here.
        Eigen::Map<Eigen::VectorXf>(out + static_cast<std::size_t>(g) * d, d) =
            ((kernel_mass * (softmax_acc_.col(g) / softmax_sum) + linear_num_.col(g)) / (kernel_mass + linear_den))
                .cast<float>();
    }
}

std::vector<int64_t> StreamingHeadState::exact_positions() const {
    std::vector<int64_t> positions(exact_positions_.begin(), exact_positions_.begin() + sink_count_);
    for (int i = 0; i < recent_count_; ++i)
        positions.push_back(exact_positions_[params_.sinks + (recent_head_ + i) % params_.recent]);
    return positions;
}

double StreamingHeadState::bytes() const {
    const double exact_tokens = static_cast<double>(sink_count_) + recent_count_;
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
