#include "src/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include "sim/sweep.h"

namespace kvsim {

double round6(double x) { return std::isfinite(x) ? std::floor(x * 1e6 + 0.5) / 1e6 : x; }

void set_measured(ResultRecord& record, const StreamMetrics& m) {
    record.steps = m.steps;
    record.retained_mass = m.steps ? std::clamp(m.retained_mass / m.steps, 0.0, 1.0) : 0.0;
    record.heavy_hitter_recall =
        m.heavy_hitter_possible
            ? std::clamp(static_cast<double>(m.heavy_hitter_hits) / m.heavy_hitter_possible, 0.0, 1.0)
            : 0.0;
    record.eviction_calls = m.eviction_calls;
    if (m.output_steps) {
        record.output_rel_error = m.output_rel_error / m.output_steps;
        record.output_cosine = std::clamp(m.output_cosine / m.output_steps, -1.0, 1.0);
    }
    if (m.context_tokens) {
        record.bytes_per_token = m.cache_bytes / m.context_tokens;
        record.compression_ratio = m.fp16_bytes / m.cache_bytes;
    }
}

namespace {

std::string metric_cell(const ResultRecord& r, const std::string& metric) {
    char text[48];
    const double value = metric == "retained_mass"         ? r.retained_mass
                         : metric == "heavy_hitter_recall" ? r.heavy_hitter_recall
                         : metric == "output_rel_error"    ? r.output_rel_error
                         : metric == "output_cosine"       ? r.output_cosine
                         : metric == "bytes_per_token"     ? r.bytes_per_token
                         : metric == "compression_ratio"   ? r.compression_ratio
                         : metric == "ppl"                 ? r.ppl
                         : metric == "delta_ppl"           ? r.delta_ppl
                                                           : 0.0;
    if (std::isnan(value)) return "-";  // not measured for this row (e.g. no values in the trace)
    if (metric == "retained_mass")
        std::snprintf(text, sizeof text, "%.6f", round6(r.retained_mass));
    else if (metric == "heavy_hitter_recall")
        std::snprintf(text, sizeof text, "%.6f", round6(r.heavy_hitter_recall));
    else if (metric == "output_rel_error" || metric == "output_cosine" || metric == "bytes_per_token" ||
             metric == "compression_ratio") {
        const double v = metric == "output_rel_error" ? r.output_rel_error
                         : metric == "output_cosine"  ? r.output_cosine
                         : metric == "bytes_per_token" ? r.bytes_per_token
                                                       : r.compression_ratio;
        std::snprintf(text, sizeof text, metric == "bytes_per_token" ? "%.1f" : metric == "compression_ratio" ? "%.3f" : "%.6f", v);
    } else if (metric == "ppl" || metric == "delta_ppl") {
        // Four decimals where they fit; a huge perplexity (a random-weight model's reaches 1e200)
        // in six significant digits, where fixed notation overran the cell and was cut short.
        // One that overflows a double is "inf", with the mean NLL it came from beside it.
        const bool huge = !(std::fabs(value) < 1e9);
        if (metric == "ppl" && std::isinf(value) && !std::isnan(r.nll))
            std::snprintf(text, sizeof text, "inf (NLL %.4f)", r.nll);
        else if (metric == "ppl")
            std::snprintf(text, sizeof text, huge ? "%.6g" : "%.4f", value);
        else
            std::snprintf(text, sizeof text, huge ? "%+.6g" : "%+.4f", value);
    }
    else if (metric == "eviction_calls")
        std::snprintf(text, sizeof text, "%lld", static_cast<long long>(r.eviction_calls));
    else
        std::snprintf(text, sizeof text, "%zu", r.policy_bytes_per_slot);
    return text;
}

const char* metric_title(const std::string& metric) {
    if (metric == "retained_mass") return "retained attention mass (mean over steps, before eviction)";
    if (metric == "heavy_hitter_recall") return "heavy-hitter recall (top-k positions of each step kept)";
    if (metric == "eviction_calls") return "eviction calls";
    if (metric == "output_rel_error") return "attention output: relative L2 error against the full fp cache (mean over heads and steps)";
    if (metric == "output_cosine") return "attention output: cosine similarity with the full fp cache";
    if (metric == "bytes_per_token") return "bytes held per token of context per (layer, KV head): K, V, scales, bookkeeping";
    if (metric == "compression_ratio") return "compression ratio against a full fp16 cache";
    if (metric == "ppl") return "perplexity with the policy controlling the model's cache";
    if (metric == "delta_ppl") return "perplexity rise over the full cache";
    return "policy bookkeeping bytes per cached token";
}

std::string optional_number(double x) { return std::isnan(x) ? std::string() : exact_number(x); }

// A perplexity or its rise in CSV: empty when not measured, "inf" or "-inf" where it overflowed.
std::string perplexity_field(double x) {
    if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
    return optional_number(x);
}

// ... and in JSON, where a number beyond a double cannot be written: the string "inf" or "-inf".
nlohmann::ordered_json perplexity_json(double x) {
    if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
    return x;
}

// Column widths: each at least its header (and `minimum`), widened to its longest cell.
std::size_t column_width(std::size_t header, const std::vector<std::string>& cells, std::size_t minimum = 8) {
    std::size_t width = std::max(header, minimum);
    for (const std::string& cell : cells) width = std::max(width, cell.size());
    return width;
}

// A configuration as one row names it: the policy's label, and its budget where it has one.
std::string configuration_name(const ResultRecord& r) {
    return r.budget_label == kEveryBudget ? r.label : r.label + " @ " + r.budget_label;
}

// A whole-trace record: over every layer and sequence.
bool pooled(const ResultRecord& r) { return r.layer < 0 && r.sequence < 0; }

std::string csv_field(const std::string& s) {
    if (s.find_first_of(",\"\n") == std::string::npos) return s;
    std::string out = "\"";
    for (char c : s) out += (c == '"') ? std::string("\"\"") : std::string(1, c);
    return out + "\"";
}

std::string params_text(const ParamValues& params) {
    std::string text;
    for (const auto& [name, value] : params) text += (text.empty() ? "" : ";") + name + "=" + format_param(value);
    return text;
}

}  // namespace

std::string exact_number(double x) {
    if (!std::isfinite(x)) return "null";
    char text[32];
    std::snprintf(text, sizeof text, "%.17g", x);
    return text;
}

std::string format_table(const std::vector<ResultRecord>& records, const std::vector<std::string>& metrics,
                         const std::string& title) {
    std::vector<std::string> rows, columns;
    std::map<std::pair<std::string, std::string>, const ResultRecord*> cell;
    for (const ResultRecord& r : records) {
        if (!pooled(r)) continue;
        if (std::find(rows.begin(), rows.end(), r.label) == rows.end()) rows.push_back(r.label);
        if (r.budget_label != kEveryBudget &&
            std::find(columns.begin(), columns.end(), r.budget_label) == columns.end())
            columns.push_back(r.budget_label);
        cell[{r.label, r.budget_label}] = &r;
    }
    if (columns.empty()) columns.push_back(kEveryBudget);  // only policies that keep everything
    std::size_t label_width = 6;
    for (const auto& row : rows) label_width = std::max(label_width, row.size());

    std::string out = title.empty() ? "" : title + "\n";
    for (const std::string& metric : metrics) {
        out += "\n" + std::string(metric_title(metric)) + "\n";
        std::vector<std::vector<std::string>> values(columns.size());  // [column][row]
        for (std::size_t i = 0; i < columns.size(); ++i)
            for (const auto& row : rows) {
                auto it = cell.find({row, columns[i]});
                if (it == cell.end()) it = cell.find({row, kEveryBudget});  // a baseline fills its row
                values[i].push_back(it == cell.end() ? "-" : metric_cell(*it->second, metric));
            }
        std::string header = "  " + std::string("policy") + std::string(label_width - 6, ' ');
        std::vector<std::size_t> widths;
        for (std::size_t i = 0; i < columns.size(); ++i) {
            const std::string name = "B=" + columns[i];
            widths.push_back(column_width(name.size(), values[i]));
            header += "  " + std::string(widths.back() - name.size(), ' ') + name;
        }
        out += header + "\n  " + std::string(header.size() - 2, '-') + "\n";
        for (std::size_t r = 0; r < rows.size(); ++r) {
            std::string line = "  " + rows[r] + std::string(label_width - rows[r].size(), ' ');
            for (std::size_t i = 0; i < columns.size(); ++i)
                line += "  " + std::string(widths[i] - values[i][r].size(), ' ') + values[i][r];
            out += line + "\n";
        }
    }
    return out + format_sequence_tables(records, metrics);
}

std::string format_sequence_tables(const std::vector<ResultRecord>& records, const std::vector<std::string>& metrics) {
    std::vector<std::string> rows, columns;
    std::map<std::pair<std::string, std::string>, const ResultRecord*> cell;
    for (const ResultRecord& r : records) {
        if (r.sequence < 0 || r.layer >= 0) continue;
        const std::string row = configuration_name(r);
        if (std::find(rows.begin(), rows.end(), row) == rows.end()) rows.push_back(row);
        if (std::find(columns.begin(), columns.end(), r.sequence_name) == columns.end())
            columns.push_back(r.sequence_name);
        cell[{row, r.sequence_name}] = &r;
    }
    if (rows.empty()) return "";
    std::size_t label_width = 13;
    for (const auto& row : rows) label_width = std::max(label_width, row.size());
    std::string out;
    for (const std::string& metric : metrics) {
        out += "\n" + std::string(metric_title(metric)) + ", by sequence\n";
        std::vector<std::vector<std::string>> values(columns.size());  // [column][row]
        for (std::size_t i = 0; i < columns.size(); ++i)
            for (const auto& row : rows) {
                const auto it = cell.find({row, columns[i]});
                values[i].push_back(it == cell.end() ? "-" : metric_cell(*it->second, metric));
            }
        std::string header = "  configuration" + std::string(label_width - 13, ' ');
        std::vector<std::size_t> widths;
        for (std::size_t i = 0; i < columns.size(); ++i) {
            widths.push_back(column_width(columns[i].size(), values[i]));
            header += "  " + std::string(widths.back() - columns[i].size(), ' ') + columns[i];
        }
        out += header + "\n  " + std::string(header.size() - 2, '-') + "\n";
        for (std::size_t r = 0; r < rows.size(); ++r) {
            std::string line = "  " + rows[r] + std::string(label_width - rows[r].size(), ' ');
            for (std::size_t i = 0; i < columns.size(); ++i)
                line += "  " + std::string(widths[i] - values[i][r].size(), ' ') + values[i][r];
            out += line + "\n";
        }
    }
    return out;
}

std::string format_comparison(const std::vector<ResultRecord>& records, const std::vector<std::string>& metrics,
                              const std::string& title) {
    std::vector<const ResultRecord*> rows;
    for (const ResultRecord& r : records)
        if (pooled(r)) rows.push_back(&r);
    std::stable_sort(rows.begin(), rows.end(), [](const ResultRecord* a, const ResultRecord* b) {
        const double x = std::isnan(a->bytes_per_token) ? 1e300 : a->bytes_per_token;
        const double y = std::isnan(b->bytes_per_token) ? 1e300 : b->bytes_per_token;
        return x < y;
    });
    auto name = [](const ResultRecord* r) { return configuration_name(*r); };
    std::size_t width = 13;
    for (const ResultRecord* r : rows) width = std::max(width, name(r).size());
    std::string out = title.empty() ? "" : title + "\n";
    out += "\nconfigurations by memory held (bytes per token of context per layer and KV head)\n";
    std::vector<std::vector<std::string>> values(metrics.size());  // [metric][row]
    for (std::size_t i = 0; i < metrics.size(); ++i)
        for (const ResultRecord* r : rows) values[i].push_back(metric_cell(*r, metrics[i]));
    std::string header = "  configuration" + std::string(width - 13, ' ');
    std::vector<std::size_t> widths;
    for (std::size_t i = 0; i < metrics.size(); ++i) {
        widths.push_back(column_width(metrics[i].size(), values[i], 9));
        header += "  " + std::string(widths.back() - metrics[i].size(), ' ') + metrics[i];
    }
    out += header + "\n  " + std::string(header.size() - 2, '-') + "\n";
    for (std::size_t row = 0; row < rows.size(); ++row) {
        const std::string label = name(rows[row]);
        std::string line = "  " + label + std::string(width - label.size(), ' ');
        for (std::size_t i = 0; i < metrics.size(); ++i)
            line += "  " + std::string(widths[i] - values[i][row].size(), ' ') + values[i][row];
        out += line + "\n";
    }
    return out + format_sequence_tables(records, metrics);
}

std::string format_csv(const std::vector<ResultRecord>& records) {
    std::string out = "policy,label,params,budget,budget_label,layer,steps,retained_mass,heavy_hitter_recall,eviction_calls,"
                      "policy_bytes_per_slot,output_rel_error,output_cosine,bytes_per_token,compression_ratio,ppl,delta_ppl,"
                      "nll,sequence,sequence_name\n";
    for (const ResultRecord& r : records) {
        out += csv_field(r.policy) + "," + csv_field(r.label) + "," + csv_field(params_text(r.params)) + "," +
               (r.budget ? std::to_string(*r.budget) : std::string()) + "," + csv_field(r.budget_label) + "," + (r.layer < 0 ? std::string("all") : std::to_string(r.layer)) + "," +
               std::to_string(r.steps) + "," + exact_number(r.retained_mass) + "," +
               exact_number(r.heavy_hitter_recall) + "," + std::to_string(r.eviction_calls) + "," +
               std::to_string(r.policy_bytes_per_slot) + "," + optional_number(r.output_rel_error) + "," +
               optional_number(r.output_cosine) + "," + optional_number(r.bytes_per_token) + "," +
               optional_number(r.compression_ratio) + "," + perplexity_field(r.ppl) + "," +
               perplexity_field(r.delta_ppl) + "," + optional_number(r.nll) + "," +
               (r.sequence < 0 ? std::string("all") : std::to_string(r.sequence)) + "," + csv_field(r.sequence_name) +
               "\n";
    }
    return out;
}

std::string format_json(const std::vector<ResultRecord>& records, const std::string& trace) {
    // One record per line, so a results file reads (and diffs) as a table does.
    std::string out = "[\n";
    for (std::size_t i = 0; i < records.size(); ++i) {
        const ResultRecord& r = records[i];
        nlohmann::ordered_json record;
        record["policy"] = r.policy;
        record["label"] = r.label;
        record["params"] = nlohmann::ordered_json::object();
        for (const auto& [name, value] : r.params) record["params"][name] = value;
        // null: no token budget applies (the policy keeps every token, or a ratio column's
        // budget differs by sequence: each per-sequence record has its own).
        record["budget"] = r.budget ? nlohmann::ordered_json(*r.budget) : nlohmann::ordered_json(nullptr);
        record["budget_label"] = r.budget_label;  // the table column: "256", "2x", a profile's name, or "full"
        if (!r.layer_budgets.empty()) {
            record["budget_profile"] = r.budget_label;
            record["layer_budgets"] = r.layer_budgets;
        }
        if (r.layer >= 0) record["layer"] = r.layer;
        if (r.sequence >= 0) record["sequence"] = {{"index", r.sequence}, {"name", r.sequence_name}};
        record["trace"] = trace;
        record["steps"] = r.steps;
        record["retained_mass"] = r.retained_mass;
        record["heavy_hitter_recall"] = r.heavy_hitter_recall;
        record["eviction_calls"] = r.eviction_calls;
        record["policy_bytes_per_slot"] = r.policy_bytes_per_slot;
        if (!std::isnan(r.output_rel_error)) {
            record["output_rel_error"] = r.output_rel_error;
            record["output_cosine"] = r.output_cosine;
        }
        if (!std::isnan(r.bytes_per_token)) {
            record["bytes_per_token"] = r.bytes_per_token;
            record["compression_ratio"] = r.compression_ratio;
        }
        if (!std::isnan(r.ppl)) {
            record["ppl"] = perplexity_json(r.ppl);
            record["delta_ppl"] = perplexity_json(r.delta_ppl);
            record["nll"] = r.nll;  // mean per predicted token, nats: ppl = exp(nll)
        }
        out += "  " + to_json_text(record) + (i + 1 < records.size() ? ",\n" : "\n");
    }
    return out + "]\n";
}

std::string to_json_text(const nlohmann::ordered_json& value, int indent) {
    // Names and labels come from user files: bytes that are not UTF-8 become U+FFFD rather than
    // an exception or invalid JSON. Non-finite numbers are written as null.
    return value.dump(indent, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

}  // namespace kvsim
